"""The built-in accelerator specifications (remat.target.devices): every number sourced and dense, lookup by
name and alias, user specs from Python or JSON and the errors that say what to fix. No torch, milliseconds."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from remat.errors import InvalidInputError
from remat.target import devices
from remat.target.devices import KNOWN, NUMBERS, DeviceSpec, cpu_spec, device_spec

ASKED = ("a100-40gb", "a100-80gb", "h100-80gb", "h100-96gb", "h100-pcie", "h200", "b200", "l4", "mi300x")


def test_the_table_holds_the_devices_asked_for_each_valid_and_every_number_sourced():
    assert set(ASKED) <= set(KNOWN)
    for name, spec in KNOWN.items():
        assert spec.name == name and spec.title and spec.vendor in ("NVIDIA", "AMD") and spec.link_kind
        assert DeviceSpec.from_dict(spec.to_dict()) == spec  # valid: it passes the checks a user spec passes
        for field in NUMBERS:
            value = getattr(spec, field)
            assert value is None or (isinstance(value, int) and value > 0), (name, field, value)
            if value is not None:
                assert spec.sources_of(field), f"{name}.{field} has no source"
                assert all(doc and note for doc, note in spec.sources_of(field)), (name, field)
        assert spec.memory_bytes is not None and spec.bf16_flops_per_s and spec.hbm_bytes_per_s
        for _, doc, note in spec.sources:
            assert "doc:" not in doc + note, f"{name}: an unexpanded document reference in {doc!r} / {note!r}"


def test_dense_figures_rank_as_the_dtypes_do():
    """Sparse figures cannot be told from dense ones by the numbers alone, but the ranking can be checked: FP8
    above BF16 above TF32 above plain FP32, BF16 = FP16 on every part here."""
    for name, s in KNOWN.items():
        rates = [r for r in (s.fp8_flops_per_s, s.bf16_flops_per_s, s.tf32_flops_per_s, s.fp32_flops_per_s)
                 if r is not None]
        assert rates == sorted(rates, reverse=True) and len(set(rates)) == len(rates), name
        assert s.bf16_flops_per_s == s.fp16_flops_per_s, name
        assert s.hbm_bytes_per_s > s.link_bytes_per_s, name


def test_known_figures():
    h100 = KNOWN["h100-80gb"]
    assert (h100.bf16_flops_per_s, h100.fp8_flops_per_s) == (989_500_000_000_000, 1_979_000_000_000_000)
    assert str(h100) == "NVIDIA H100 SXM 80GB (79.2 GiB)" == h100.describe()
    assert KNOWN["a100-80gb"].fp8_flops_per_s is None  # no FP8 on Ampere
    assert KNOWN["h100-96gb"].hbm_bytes_per_s == 2_400_000_000_000  # torchtitan's HBM2e H100


@pytest.mark.parametrize("asked, name", [
    ("H100", "h100-80gb"), ("h100-sxm", "h100-80gb"), ("H100_SXM", "h100-80gb"), ("NVIDIA H100 80GB HBM3", "h100-80gb"),
    ("A100-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("  h200 ", "h200"), ("MI300X", "mi300x"),
    ("AMD Instinct MI300X", "mi300x"), ("L4", "l4"), ("B200", "b200"), ("h100-pcie", "h100-pcie"),
])
def test_lookup_by_name_alias_and_any_case(asked, name):
    assert device_spec(asked) is KNOWN[name]


def test_a_spec_is_itself_and_a_mapping_is_a_spec():
    spec = DeviceSpec(name="x", memory_bytes=10**9)
    assert device_spec(spec) is spec
    assert device_spec({"name": "x", "memory_bytes": 10**9}) == spec


def test_an_unknown_name_lists_the_known_ones_and_how_to_define_a_device():
    with pytest.raises(InvalidInputError) as info:
        device_spec("h300")
    message = str(info.value)
    assert "'h300'" in message
    assert all(name in message for name in KNOWN) and "cpu" in message
    assert '{"name": "my-gpu", "memory_bytes":' in message  # the JSON form
    assert 'DeviceSpec(name="my-gpu", memory_bytes=' in message  # the Python form
    assert "total_memory" in message


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_json_round_trip_through_a_file(tmp_path: Path, name: str):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(KNOWN[name].to_dict()))
    assert device_spec(path) == KNOWN[name] == device_spec(str(path))


def test_a_users_json_with_only_the_required_fields_and_floats(tmp_path: Path):
    path = tmp_path / "mine.json"
    path.write_text('{"name": "my-gpu", "memory_bytes": 85e9, "bf16_flops_per_s": 989.5e12}')
    spec = device_spec(path)
    assert spec.memory_bytes == 85_000_000_000 and spec.bf16_flops_per_s == 989_500_000_000_000
    assert isinstance(spec.memory_bytes, int) and isinstance(spec.bf16_flops_per_s, int)
    assert spec.tf32_flops_per_s is None and spec.sources == ()
    assert str(spec) == "my-gpu (79.2 GiB)"


@pytest.mark.parametrize("fields, named", [
    ({"memory_bytes": -1}, "memory_bytes"),
    ({"memory_bytes": 0}, "memory_bytes"),
    ({"memory_bytes": 1.5}, "memory_bytes"),
    ({"memory_bytes": "80GB"}, "memory_bytes"),
    ({"memory_bytes": True}, "memory_bytes"),
    ({"memory_bytes": 10**9, "bf16_flops_per_s": -3}, "bf16_flops_per_s"),
    ({"memory_bytes": 10**9, "hbm_bytes_per_s": float("nan")}, "hbm_bytes_per_s"),
    ({"memory_bytes": 10**9, "sources": [("memry_bytes", "doc", "note")]}, "(field, document, note)"),
])
def test_a_bad_user_spec_is_refused_naming_the_field(fields, named):
    with pytest.raises(InvalidInputError, match=r"'mine'.*" + named.replace("(", r"\(").replace(")", r"\)")):
        DeviceSpec(name="mine", **fields)


def test_a_spec_without_memory_says_it_is_required_and_how():
    with pytest.raises(InvalidInputError, match="memory_bytes is required.*total_memory"):
        DeviceSpec(name="mine", memory_bytes=None)
    with pytest.raises(InvalidInputError, match=r"lacks memory_bytes[\s\S]*DeviceSpec\(name="):
        DeviceSpec.from_dict({"name": "mine"})
    with pytest.raises(InvalidInputError, match=r"unknown field\(s\) \['memory_gb'\]"):
        DeviceSpec.from_dict({"name": "mine", "memory_bytes": 10**9, "memory_gb": 80})


def test_a_bad_file_is_refused_naming_it(tmp_path: Path):
    with pytest.raises(InvalidInputError, match="no device spec file"):
        device_spec(tmp_path / "absent.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(InvalidInputError, match="cannot read the device spec .*broken.json"):
        device_spec(broken)
    negative = tmp_path / "negative.json"
    negative.write_text('{"name": "neg", "memory_bytes": -5}')
    with pytest.raises(InvalidInputError, match="negative.json: device 'neg': memory_bytes must be positive"):
        device_spec(str(negative))
    with pytest.raises(InvalidInputError, match="a device is a name"):
        device_spec(80)


def test_cpu_is_this_machine_with_unknown_rates():
    spec = device_spec("cpu")
    assert spec.name == "cpu" and spec.memory_bytes > 0 and spec.sources_of("memory_bytes")
    assert all(getattr(spec, r) is None for r in devices.RATES)
    mine = cpu_spec(8 * 2**30)
    assert mine.memory_bytes == 8 * 2**30 and str(mine).endswith("(8.0 GiB)")


def test_the_module_imports_no_torch():
    tree = ast.parse(Path(devices.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in imported and imported <= {"__future__", "dataclasses", "json", "math", "os", "platform",
                                                    "re", "collections", "importlib", "pathlib", "types", "typing",
                                                    "remat"}
