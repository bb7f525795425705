"""Offloaded units (issue #50, the mechanism: Note [Offloaded units] in remat.rewrite.offload): the saved
activations of chosen modules go to host buffers in the forward and come back for the backward. On this CPU the
"device" is host memory too, so what is checked here is the mechanism: exactness, the pool, the bookkeeping, what
a step's own allocations are once the pool is warm; not what a GPU would free or how long its copies take."""

import copy
import dataclasses

import pytest
import torch

import remat
import remat.costs.offload
from helpers import needs_compiled_floor, needs_fake_world_floor
from remat._compat import storage_key
from remat.errors import InvalidInputError, PlanMismatchError, UnsupportedError
from remat.examples import make_gpt
from remat.rewrite import checkpoint_modules, checkpointed_modules, remove_checkpointing
from remat.rewrite.install import offloaded_modules
from remat.rewrite.offload import MIN_OFFLOAD_BYTES, offload_modules, offloadable, offloader_for
from remat.runtime.tracker import StorageTracker

BLOCKS = ["h.0", "h.1", "h.2", "h.3"]


def _gpt():
    model, (idx, targets), _ = make_gpt()
    return model, idx, targets


def _steps(model, idx, targets, n=3, seed=7):
    """``n`` AdamW steps, dropout on, each seeded alike: the losses, the last step's gradients, the parameters
    and buffers after them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i in range(n):
        torch.manual_seed(seed + i)
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, grads, [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def test_offloaded_blocks_train_bitwise_as_the_plain_model_with_dropout_on():
    """Nothing is recomputed, so nothing is drawn again: three AdamW steps with every block's activations
    offloaded give the plain model's losses, gradients, parameters and buffers, bitwise."""
    model, idx, targets = _gpt()
    plain = copy.deepcopy(model)
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    offload_modules(model, BLOCKS)
    got, expected = _steps(model, idx, targets), _steps(plain, idx, targets)
    for a, b in zip(got, expected):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    off = offloader_for(model)
    assert off.offloaded_tensors > 0 and off.offloaded_bytes >= off.offloaded_tensors * MIN_OFFLOAD_BYTES


def test_a_broken_copy_back_is_caught_by_the_exactness_test(monkeypatch):
    """The check above can fail: a copy back that perturbs one element changes the gradients."""
    import remat.rewrite.offload as offload

    model, idx, targets = _gpt()
    plain = copy.deepcopy(model)
    offload_modules(model, BLOCKS)
    real = offload.Offloader.unpack

    def perturbed(self, unit, packed):
        out = real(self, unit, packed)
        return out + 1e-3 if isinstance(packed, offload._Saved) and out.is_floating_point() else out

    monkeypatch.setattr(offload.Offloader, "unpack", perturbed)
    got, expected = _steps(model, idx, targets, n=1), _steps(plain, idx, targets, n=1)
    assert not all(torch.equal(x, y) for x, y in zip(got[1], expected[1]))


def test_the_host_pool_is_reused_from_the_second_step_and_every_buffer_comes_back():
    model, idx, targets = _gpt()
    offload_modules(model, BLOCKS)
    off = offloader_for(model)
    _steps(model, idx, targets, n=1)
    allocated, held = off.pool.allocations, off.pool.held_bytes
    assert allocated > 0 and off.pool.in_use_bytes == 0
    _steps(model, idx, targets, n=3)
    assert (off.pool.allocations, off.pool.held_bytes, off.pool.in_use_bytes) == (allocated, held, 0)


def test_with_a_warm_pool_the_steps_own_allocations_peak_lower_than_the_plain_steps():
    """What this CPU can show of the memory: with the host buffers allocated by the first step (apart from the
    step's own allocations, as a GPU's pinned pool is apart from its device memory), the forward and backward's
    own peak, read by remat's dispatch-level meter, is below the plain step's by most of what was offloaded."""
    def peak(model, pool=()):
        with StorageTracker("cpu", ignore=pool) as tracker:
            torch.manual_seed(1)
            logits = model(idx)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        model.zero_grad(set_to_none=True)
        return tracker.peak_bytes

    model, idx, targets = _gpt()
    plain = peak(copy.deepcopy(model))
    offload_modules(model, BLOCKS)
    peak(model)  # warms the pool
    off = offloader_for(model)
    before = off.offloaded_bytes
    offloaded = peak(model, off.pool.buffers())
    moved = off.offloaded_bytes - before
    assert offloaded < plain, (offloaded, plain)
    # a block's tensors come back one block ahead: two blocks' worth may be back at once
    assert plain - offloaded >= moved - 2 * moved // len(BLOCKS), (plain, offloaded, moved)


def test_offloading_touches_nothing_else_and_is_undone():
    model, idx, targets = _gpt()
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    offload_modules(model, ["h.1", "h.3"])
    assert offloaded_modules(model) == ["h.1", "h.3"] and checkpointed_modules(model) == []
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert remove_checkpointing(model) == ["h.1", "h.3"]
    assert offloaded_modules(model) == [] and all("forward" not in m.__dict__ for m in model.modules())


def test_a_unit_is_kept_recomputed_or_offloaded_not_two_of_them():
    model, _, _ = _gpt()
    checkpoint_modules(model, ["h.0"])
    with pytest.raises(InvalidInputError, match="one of the three"):
        offload_modules(model, ["h.0"])
    with pytest.raises(PlanMismatchError, match="no module named"):
        offload_modules(model, ["h.9"])


def test_a_second_backward_through_an_offloaded_unit_is_refused_with_what_to_do():
    model, idx, targets = _gpt()
    offload_modules(model, ["h.0"])
    loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    loss.backward(retain_graph=True)
    with pytest.raises(UnsupportedError, match="retain_graph"):
        loss.backward()


def test_small_storages_parameters_and_the_units_inputs_stay_and_a_view_comes_back_as_the_same_view():
    from remat.rewrite.offload import Offloader

    big = torch.randn(256, 256, requires_grad=True) * 2
    assert offloadable(big) and offloadable(big.t()[3:])  # a view goes with its storage
    assert not offloadable(torch.randn(8, 8) * 2)  # small
    assert not offloadable(torch.nn.Parameter(torch.randn(256, 256)))
    assert not offloadable(big, keep=frozenset({storage_key(big)}))
    off = Offloader()
    view = big.detach().t()[3:]
    saved = [off.pack("u", t) for t in (big.detach(), view)]
    assert off.offloaded_tensors == 1  # one storage, parked once
    back = [off.unpack("u", s) for s in saved]
    assert torch.equal(back[0], big) and torch.equal(back[1], view)
    assert (back[1].stride(), back[1].storage_offset()) == (view.stride(), view.storage_offset())
    assert back[0].untyped_storage().data_ptr() == back[1].untyped_storage().data_ptr()


def _loss(targets):
    return lambda out: torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("offload, error", [(True, UnsupportedError), ("yes", InvalidInputError)])
def test_offloading_a_step_that_runs_on_this_cpu_is_refused_saying_why(offload, error):
    model, idx, targets = _gpt()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match="CPU|offload takes"):
        remat.optimize_checkpointing(model, 1.0, idx, loss_fn=_loss(targets), offload=offload)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.values()))
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_auto_plans_a_cpu_step_without_offloading_and_says_why():
    model, idx, targets = _gpt()
    plan = remat.optimize_checkpointing(model, 0.05, idx, loss_fn=_loss(targets), offload="auto", check=False,
                                        granularity="block")
    assert plan.offloaded == ()
    assert any(n.startswith("offloading not offered: the step runs on a CPU") for n in plan.notes)


def _replayed(target, plan):
    from remat.api.predict import predict_peaks

    model, idx, targets = _gpt()
    return predict_peaks(model, idx, target, loss_fn=_loss(targets), plan=plan).allocated_peak_bytes


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=needs_fake_world_floor)])
def test_a_plan_for_a_gpu_offloads_and_the_replayed_step_frees_what_it_offloads(world):
    """For an H100 target (one GPU, and FSDP2 over two on the fake process group): a budget between the least
    peak and no checkpointing's is planned with some units offloaded; the allocator's replay of the recorded step
    with the plan sees the offloaded units' activations leave (its allocated peak below the same plan's with
    those units kept)."""
    model, idx, targets = _gpt()
    target = remat.Target(device="h100-80gb", world=world)
    profile = remat.make_profile(model, idx, loss_fn=_loss(targets), target=target)
    planner = remat.Planner(profile, offload=remat.costs.offload.HostLink(63e9, 63e9))
    budget = (planner.min_peak_bytes + planner.baseline_peak_bytes) // 2
    plan = planner.plan_for_budget(budget)
    assert plan.offloaded, plan
    kept = dataclasses.replace(plan, offloaded=())
    assert _replayed(target, plan) < _replayed(target, kept)
    # and from the front door: offload=True names what it offloads and the link
    plan = remat.optimize_checkpointing(model, 0.2, idx, loss_fn=_loss(targets), target=target, offload=True,
                                        granularity="block")
    assert any("offloading offered over h100-80gb's host link, 54.5 GB/s to host (not measured: 86% of the nominal "
               "rate, carried from h200)" in n for n in plan.notes)
    assert plan.predicted_reserved_bytes <= 0.2 * 2**30


def test_offloading_a_tensor_parallel_target_is_refused_and_auto_leaves_it_out():
    """Its saved activations are DTensors, which the hooks leave on the device: offered, the plan would predict
    frees that do not happen."""
    from remat.api.offloading import host_link

    target = remat.Target(device="h100-80gb", world=2, tp=2)
    with pytest.raises(UnsupportedError, match="tensor parallel"):
        host_link(True, device=torch.device("cpu"), target=target)
    link, notes = host_link("auto", device=torch.device("cpu"), target=target)
    assert link is None and "tensor parallel" in notes[0]
    link, _ = host_link("auto", device=torch.device("cpu"), target=remat.Target(device="h100-80gb", world=2))
    # the H100's nominal 63.0 GB/s at the share of it the H200's measured copies reached (54.5 of 63.0)
    assert link is not None and link.to_host_bytes_per_s == pytest.approx(54.5e9, rel=1e-3)


def test_a_storage_the_units_output_holds_stays_on_the_device_and_is_read_there():
    """A unit whose last operator saves its own output (ReLU): the output lives on after the unit, so offloading
    it would free nothing and bring back a second copy; it stays, its host buffer goes back to the pool, and the
    step is still exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Sequential(torch.nn.Linear(256, 256),
                                                                                torch.nn.ReLU()),
                                torch.nn.Linear(256, 4))
    x = torch.randn(128, 256)
    plain = copy.deepcopy(model)
    offload_modules(model, ["1"])
    off = offloader_for(model)
    out = model(x)
    kept = [r() for r in off.parked["1"] if r() is not None and r().ready is not None]
    assert len(kept) == 1 and kept[0].buf is None  # the ReLU's output, read where it is
    out.sum().backward()
    plain(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    assert off.pool.in_use_bytes == 0


@needs_compiled_floor
def test_offloading_a_compiled_loop_is_refused_naming_the_releases_checked():
    model, idx, targets = _gpt()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedError, match=r"compiles the model .*2\.8, 2\.13, 2\.15.*should_offload"):
        remat.optimize_checkpointing(model, 1.0, idx, loss_fn=_loss(targets), offload=True,
                                     compile={"backend": "aot_eager"})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.values()))
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_the_installed_torch_still_does_not_offload_a_compiled_step_from_a_checkpoint_policy():
    """What the refusal above says of torch, read from the installed torch's own files: no module reads the
    CPU_OFFLOAD policies (the enum's own file declares them), and nothing marks a graph node ``should_offload``
    (the compiled offloading pass only reads it). A torch that wires them fails here: then remat can offload
    compiled steps through it, and the refusal must say from which release."""
    import re
    from pathlib import Path

    root = Path(torch.__file__).parent
    readers, markers = [], []
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "CPU_OFFLOAD" in text and path.relative_to(root).as_posix() != "utils/checkpoint.py":
            if re.search(r"CheckpointPolicy\.(MUST|PREFER)_CPU_OFFLOAD", text):
                readers.append(str(path.relative_to(root)))
        if re.search(r"""\[["']should_offload["']\]\s*=""", text):
            markers.append(str(path.relative_to(root)))
    checkpoint = (root / "utils" / "checkpoint.py").read_text()
    uses = [line for line in checkpoint.splitlines()
            if re.search(r"CheckpointPolicy\.(MUST|PREFER)_CPU_OFFLOAD", line)]
    assert (readers, markers, uses) == ([], [], []), (readers, markers, uses)


def _parts_of(unit: str):
    """A GPT, its profile on this CPU planned with a host link (so that offloading is offered: a plan for a GPU's
    link, applied here to test the mechanism), and the offload options of ``unit``: whole and its parts."""
    from remat.costs.offload import HostLink

    model, idx, targets = _gpt()
    planner = remat.Planner(remat.make_profile(model, idx, loss_fn=_loss(targets)), offload=HostLink(63e9, 63e9),
                            granularity="op")
    return planner, {k: s for k, s in planner.model.offloads.items()
                     if k.split("~")[0] == remat.costs.offload.offload_key(unit)}


def test_an_offloaded_part_moves_exactly_what_its_operators_made_and_trains_bitwise():
    """Note [Offloaded parts]: for every option of h.1 and of h.1.attn (the whole unit, and parts named by the
    operators that made their storages: the attention's softmax, its dropout mask, the MLP's matmul), the step
    moves to host memory exactly the bytes the memory model predicts the option frees; and three AdamW steps with
    a part offloaded (dropout on) are bitwise the plain model's."""
    for unit in ("h.1", "h.1.attn"):
        planner, options = _parts_of(unit)
        assert len(options) >= 3 and any(s.ops for s in options.values())
        for key, span in options.items():
            model, idx, targets = _gpt()
            remat.apply_plan(model, planner.make_plan([key], "one"))
            moved = []
            for _ in range(2):
                offloader = offloader_for(model)
                offloader.offloaded_bytes = 0
                _loss(targets)(model(idx)).backward()
                moved.append(offloader.offloaded_bytes)
            assert moved == [span.nbytes, span.nbytes], (key, span.ops, moved)
    part = next(k for k, s in options.items() if "aten.empty_like.default#0" in s.ops)  # the dropout mask
    model, idx, targets = _gpt()
    plain = _steps(model, idx, targets)
    model, idx, targets = _gpt()
    remat.apply_plan(model, planner.make_plan([part], "part"))
    for a, b in zip(plain, _steps(model, idx, targets)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_part_whose_operators_are_counted_wrongly_moves_other_bytes_and_is_caught(monkeypatch):
    """The check above fails where the mechanism names operators differently from the recording (each
    overload counted from 1, not 0)."""
    from remat.rewrite.policy import PolicyNames

    planner, options = _parts_of("h.1")
    key, span = next((k, s) for k, s in options.items() if s.ops)
    key_of = PolicyNames.key
    monkeypatch.setattr(PolicyNames, "key", lambda self, *a: (lambda k: k and k[:-1] + str(int(k[-1]) + 1))(
        key_of(self, *a)))
    model, idx, targets = _gpt()
    remat.apply_plan(model, planner.make_plan([key], "one"))
    _loss(targets)(model(idx)).backward()
    assert offloader_for(model).offloaded_bytes != span.nbytes


def test_remats_equivalence_check_proves_an_offloaded_plan_and_catches_a_broken_copy_back(monkeypatch):
    """The plan's proof holds with offloaded units and parts in it: ``check_equivalence`` runs the offloaded step
    against the plain one (its copy with remat's rewrites removed) and finds them equal; with the copy back
    perturbed it reports the gradients that differ."""
    import remat.rewrite.offload as offload

    planner, options = _parts_of("h.1")
    part = next(k for k, s in options.items() if s.ops)
    model, idx, targets = _gpt()
    remat.apply_plan(model, planner.make_plan([part, remat.costs.offload.offload_key("h.3")], "two"))
    assert remat.check_equivalence(model, idx, loss_fn=_loss(targets)).equal
    real = offload.Offloader.unpack
    monkeypatch.setattr(offload.Offloader, "unpack", lambda self, unit, packed: (
        lambda out: out + 1e-3 if isinstance(packed, offload._Saved) and out.is_floating_point() else out)(
        real(self, unit, packed)))
    report = remat.check_equivalence(model, idx, loss_fn=_loss(targets))
    assert not report.equal and any("grad" in m for m in report.mismatched), report.mismatched


def test_for_a_gpu_the_replayed_step_frees_what_each_part_moves_and_no_more_than_predicted():
    """For an H100 target, each offload option of h.1 (whole and parts) replayed through the CUDA caching
    allocator on fake tensors lowers the step's allocated peak by exactly the bytes the option moves (this GPT's
    peak comes after h.1's forward, with every offloaded storage gone); the memory model's predicted peak falls by
    that much or less (its rows bound the step from above)."""
    from remat.costs.offload import HostLink

    model, idx, targets = _gpt()
    target = remat.Target(device="h100-80gb")
    planner = remat.Planner(remat.make_profile(model, idx, loss_fn=_loss(targets), target=target),
                            offload=HostLink(63e9, 63e9), granularity="op")
    none = planner.make_plan([], "none")
    plain = _replayed(target, none)
    options = {k: s for k, s in planner.model.offloads.items() if k.split("~")[0] == "offload:h.1"}
    assert len(options) == 4
    for key, span in options.items():
        plan = planner.make_plan([key], "one")
        assert plain - _replayed(target, plan) == span.nbytes, key
        assert 0 < none.predicted_peak_bytes - plan.predicted_peak_bytes <= span.nbytes, key


def test_the_plan_pairs_offloaded_units_by_the_recorded_order_and_the_mechanism_installs_that():
    """Note [Exposed copies] (issue #62): which unit's backward brings an offloaded unit's storages back early is
    decided when the plan is made, from the order the recorded step ran its units, and carried by the plan: ``h.0``
    by ``h.1``'s backward only where ``h.1`` is offloaded too; inside a block, the unit that runs next at its level
    (``mlp`` after ``attn``), whatever the names, never across blocks; applied as the plan says (it was re-derived
    from the names at apply time: ``layers.N`` before ``layers.N+1``, siblings never). Fails where apply time pairs
    by name."""
    from remat.rewrite import checkpoint_plan

    planner, _ = _parts_of("h.1")
    key = remat.costs.offload.offload_key
    cases = ((["h.0", "h.1", "h.3"], {"h.1": "h.0"}), (["h.0", "h.2"], {}),
             (["h.1.attn", "h.1.mlp"], {"h.1.mlp": "h.1.attn"}), (["h.1.attn", "h.2.attn"], {}))
    for names, ahead in cases:
        plan = planner.make_plan([key(n) for n in names], "offload")
        assert plan.offload_ahead == ahead, names
        assert remat.Plan.from_dict(plan.to_dict()).offload_ahead == ahead
        model, _, _ = _gpt()
        checkpoint_plan(model, plan)
        assert offloader_for(model).ahead == ahead, names
    # the pairing is the plan's, not the names': none given, none installed; one given for a unit not offloaded, none
    for given in (None, {"h.1": "h.0", "h.3": "h.2"}):
        model, _, _ = _gpt()
        offload_modules(model, ["h.0", "h.1", "h.3"], ahead=given)
        assert offloader_for(model).ahead == ({} if given is None else {"h.1": "h.0"})
    model, idx, targets = _gpt()
    offload_modules(model, ["h.0", "h.2"])
    off = offloader_for(model)
    back = []
    real = off.prefetch

    def prefetch(unit):  # after each prefetch: the units whose storages are back (or coming back)
        real(unit)
        back.append((unit, sorted(n for n, refs in off.parked.items()
                                  if any(r() is not None and r().ready is not None for r in refs))))

    off.prefetch = prefetch
    logits = model(idx)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert back[0] == ("h.2", ["h.2"])  # h.2's backward brings back h.2 only: h.0 stays parked through h.1's
    assert [u for u, _ in back] == ["h.2", "h.0"]
