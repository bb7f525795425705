"""A Hugging Face model's step recorded for a target on fake tensors takes the mask path its batch takes on the GPU
(Note [Masks decided on values] in remat._compat.transformers): no materialized causal mask and no repeated key /
value heads for a batch without padding, as the H200's history of the 1B Llama shows (tests/slow/
test_llama1b_history.py); the mask where the batch pads. Before, every fake recording built the mask (batch x 1 x
queries x keys, from three boolean ones) and repeated the heads, whatever the batch."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'remat[hf]'")
masking_utils = pytest.importorskip("transformers.masking_utils", reason="transformers >= 4.53 decides masks there")

from remat._compat import batch_layout, masks_decided_for  # noqa: E402
from remat.runtime.tracker import StorageTracker  # noqa: E402
from remat.target.world import Target, built  # noqa: E402

BATCH, SEQ, KV_HEADS, HEADS = 2, 64, 2, 4


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                                   use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).train()


def _recorded_shapes(inputs: dict) -> list[tuple[int, ...]]:
    """The shapes of the storages a step (forward, loss, backward) makes, recorded for an H100 on fake tensors."""
    model = _llama()
    with built(Target(device="h100-80gb"), model, ((), inputs)) as (fake, (args, kwargs), mode), mode:
        held = [*fake.parameters(), *fake.buffers(), *kwargs.values()]
        with StorageTracker(torch.device("cpu"), ignore=held, count_fake=True) as tracker:
            fake(*args, **kwargs).loss.backward()
    return [r.shape for r in tracker.records]


def _mask_and_repeated_heads(shapes: list[tuple[int, ...]]) -> tuple[int, int]:
    masks = sum(1 for s in shapes if s == (BATCH, 1, SEQ, SEQ))
    repeated = sum(1 for s in shapes if len(s) == 5 and s[1:3] == (KV_HEADS, HEADS // KV_HEADS))  # repeat_kv's copy
    return masks, repeated


def test_a_batch_without_padding_records_no_mask_and_no_repeated_heads():
    ids = torch.randint(0, 256, (BATCH, SEQ))
    for inputs in ({"input_ids": ids, "labels": ids},  # no mask given: the 1B Llama's step
                   {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids},  # a mask of ones
                   {"input_ids": ids.to("meta"), "labels": ids.to("meta")}):  # no values: taken as unpadded
        assert _mask_and_repeated_heads(_recorded_shapes(inputs)) == (0, 0), inputs.keys()


def test_a_padded_batch_records_the_mask_and_repeated_heads_as_the_gpu_runs_it():
    ids = torch.randint(0, 256, (BATCH, SEQ))
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    masks, repeated = _mask_and_repeated_heads(_recorded_shapes({"input_ids": ids, "attention_mask": mask,
                                                                 "labels": ids}))
    assert masks >= 1 and repeated == 2 * 2  # keys and values repeated in each of the 2 layers


def test_the_batch_layout_is_read_where_the_inputs_hold_values():
    ids = torch.randint(0, 256, (BATCH, SEQ))
    padded = torch.ones_like(ids)
    padded[1, :3] = 0
    packed = torch.cat([torch.arange(40), torch.arange(24)]).expand(BATCH, -1)
    assert batch_layout(((ids,), {})) == (None, None)
    assert batch_layout(((), {"attention_mask": torch.ones_like(ids)})) == (False, None)
    assert batch_layout(((), {"attention_mask": padded})) == (True, None)
    assert batch_layout(((), {"attention_mask": padded.to("meta")})) == (None, None)
    assert batch_layout({"position_ids": packed}) == (None, True)
    assert batch_layout({"position_ids": torch.arange(SEQ).expand(BATCH, -1)}) == (None, False)


def _causal_mask_skipped(padding_mask) -> bool:
    """transformers' ``_ignore_causal_mask_sdpa`` for a square causal mask of SEQ (its arguments differ by release)."""
    import inspect

    fn = masking_utils._ignore_causal_mask_sdpa
    names = list(inspect.signature(fn).parameters)[1:]
    given = {"q_length": SEQ, "query_length": SEQ, "kv_length": SEQ, "q_offset": 0, "kv_offset": 0}
    return fn(padding_mask, **{n: given[n] for n in names if n in given})


def test_the_helpers_answer_for_fake_tensors_only_and_are_put_back():
    from remat._compat import fake_mode

    original = masking_utils.find_packed_sequence_indices
    positions = torch.cat([torch.arange(40), torch.arange(24)]).unsqueeze(0)
    mode = fake_mode()
    with mode:
        fake_positions = torch.zeros(1, SEQ, dtype=torch.long)
        fake_padding = torch.zeros(1, SEQ, dtype=torch.bool)
    with masks_decided_for(padded=None, packed=None):
        assert masking_utils.find_packed_sequence_indices(positions) is not None  # real values: read as they are
        with mode:
            assert masking_utils.find_packed_sequence_indices(fake_positions) is None
            assert _causal_mask_skipped(fake_padding) is True
    with masks_decided_for(padded=True, packed=True), mode:
        assert masking_utils.find_packed_sequence_indices(fake_positions) is not None  # the path of unknown values
        assert _causal_mask_skipped(fake_padding) is False
    assert masking_utils.find_packed_sequence_indices is original
    with mode:  # outside: transformers' own answer for fake tensors, the mask kept
        assert _causal_mask_skipped(fake_padding) is False
