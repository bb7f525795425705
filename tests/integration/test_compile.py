"""torch.compile over remat's plans (Note [Under torch.compile] in remat.rewrite): block, selective and
segment plans compile without graph breaks, whole-model and per block (torchtitan's order: checkpoint,
then compile each block), train with gradients equal to the compiled plain model's, dropout's outputs kept
under compile (drawn again in the eager recomputation: Note [Random operators under compile] in remat.rewrite),
and the compiled forward saves fewer tensors for backward.

Inductor's code generation costs 10-60 s per model on the 2-core CPU here when its cache is cold (every fresh
virtual environment: its compile commands name the environment's include paths), so the tests here compile
with ``aot_eager``: Dynamo and AOTAutograd's partitioner, which are where checkpointing is traced, tagged and
recomputed, without generating kernels. The two that compile with inductor (remat's plans for the GPT compiled
whole and for a conv net compiled per block: what users run, and where memory is inductor's) are in
tests/slow/test_inductor.py, run by CI after the suite."""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
from torch import nn

import remat
from helpers import case
from remat.examples import make_gpt
from remat.rewrite import checkpoint_modules
from remat.runtime.compiled import left_eager
from helpers import needs_compiled_floor

STEPS = 3
#: torch.compile's backend for the tests that are about tracing, not kernels (see above)
TRACE_ONLY = "aot_eager"
#: compiled remat vs compiled plain: measured exactly equal on CPU (fallback_random); the tolerance
#: leaves room for inductor choosing another reduction order for the two graphs
ATOL = 1e-6


@contextlib.contextmanager
def eager_random():
    # inductor's own random numbers differ from eager's; with fallback_random the compiled plain and
    # compiled remat graphs draw from torch's RNG as eager does, so their dropout masks are comparable
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def eager_compatible_random():
    with eager_random():
        yield


@functools.lru_cache(maxsize=None)
def _two_block_profile():
    model, inputs, loss_fn = two_block_gpt()
    return remat.make_profile(model, inputs, loss_fn=loss_fn)


def two_block_gpt():
    return make_gpt(layers=2, batch_size=4, seq_len=16, d_model=32, heads=2, vocab=64, dropout=0.1)


def gpt_with_mixed_plan():
    """A two-block GPT (dropout 0.1) with a block unit, a module unit and a selective unit."""
    profile = _two_block_profile()
    model, inputs, loss_fn = two_block_gpt()
    options = [u for u in profile.units if u.name.startswith("h.1.mlp@ops")]
    selective = max(options, key=lambda u: len(u.saved_ops))
    units = ["h.0", "h.1.attn", selective.name]
    return model, inputs, loss_fn or remat.default_loss, units, {selective.name: selective.saved_ops}


def sequential_with_batchnorm(batch: int = 8):
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Dropout(0.1)]
    model = nn.Sequential(*layers, nn.Linear(16, 4))
    return model, torch.randn(batch, 16), lambda out: out.square().mean(), ["[0:4]", "[4:8]"], {}


def train(model, inputs, loss_fn, steps=STEPS):
    """``steps`` SGD steps from seed 0; the losses and the last step's gradients by parameter name."""
    args, kwargs = remat.runtime.measure.split_inputs(inputs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        losses.append(loss.item())
        grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads


def saved_bytes(model, inputs, loss_fn) -> int:
    """Bytes the forward saves for backward (the compiled forward's outputs kept for its backward)."""
    args, kwargs = remat.runtime.measure.split_inputs(inputs)
    storages = {}

    def pack(t):
        if t.layout == torch.strided:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(*args, **kwargs))
    loss.backward()
    return sum(storages.values())


def graph_breaks(model, inputs) -> int:
    args, kwargs = remat.runtime.measure.split_inputs(inputs)
    return torch._dynamo.explain(model)(*args, **kwargs).graph_break_count


# the GPT's mixed plan (block, module and selective units) with aot_eager_decomp_partition: inductor's
# decompositions and its min-cut partitioner, which honours the selective policy's tags, without generating
# kernels; inductor itself is tested on remat's plans below (the GPT compiled whole, the conv net per block),
# and this case with inductor cost 17-30 s of the suite (cold compile cache in a fresh clone)
@needs_compiled_floor
@pytest.mark.parametrize("make,backend", [(gpt_with_mixed_plan, "aot_eager_decomp_partition"),
                                          (sequential_with_batchnorm, TRACE_ONLY)],
                         ids=["gpt-mixed-plan", "sequential-bn"])
def test_compiled_remat_trains_like_compiled_plain(make, backend):
    model, inputs, loss_fn, units, saved_ops = make()
    plain = copy.deepcopy(model)
    checkpoint_modules(model, units, saved_ops=saved_ops)
    assert remat.checkpointed_modules(model) == units
    # this check failed before remat took its compile path: its eager wrapper mutates a counter, which
    # Dynamo refuses inside checkpoint (3 graph breaks on the GPT), and its selective policy was an object
    assert graph_breaks(copy.deepcopy(model), inputs) == 0  # (explain runs the forward: BatchNorm updates)
    ref_losses, ref_grads = train(torch.compile(plain, backend=backend), inputs, loss_fn)
    compiled = torch.compile(model, backend=backend)
    losses, grads = train(compiled, inputs, loss_fn)
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    assert worst <= ATOL, worst
    # buffers (BatchNorm running statistics) updated once per step, as in the plain model
    for (n, b), (_, ref) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.allclose(b, ref, atol=ATOL), n


def test_compiled_checkpointing_saves_less_for_backward():
    """Recomputation happens under compile: the compiled checkpointed forward saves less for its backward
    (AOTAutograd's partitioner, which decides it, with compile's own random numbers, the default: with
    ``fallback_random`` inductor cannot replay random operators in the backward graph and saves their outputs
    instead; on the Sequential above, 15.7 KB saved against the plain model's 6.8 KB)."""
    model, inputs, loss_fn, units, saved_ops = gpt_with_mixed_plan()
    plain = copy.deepcopy(model)
    checkpoint_modules(model, units, saved_ops=saved_ops)
    with torch._inductor.config.patch(fallback_random=False):
        remat_bytes = saved_bytes(torch.compile(model, backend=TRACE_ONLY), inputs, loss_fn)
        plain_bytes = saved_bytes(torch.compile(plain, backend=TRACE_ONLY), inputs, loss_fn)
    assert remat_bytes < 0.75 * plain_bytes, (remat_bytes, plain_bytes)  # 284 KB vs 454 KB measured


def test_per_block_compile_after_checkpointing():
    """torchtitan's order: checkpoint inside the blocks (each block's attention whole, its MLP selectively,
    with the same policy), then compile each block in place (``Module.compile``)."""
    c = case("gpt")
    model, inputs, loss_fn = c.fresh()
    option = max((u for u in c.profile.units if u.name.startswith("h.0.mlp@ops")), key=lambda u: len(u.saved_ops))
    policy = option.name.partition("@")[2]
    units = [name for i in range(len(model.h)) for name in (f"h.{i}.attn", f"h.{i}.mlp@{policy}")]
    saved_ops = {u: c.profile.unit(u).saved_ops for u in units if "@" in u}
    plain = copy.deepcopy(model)
    checkpoint_modules(model, units, saved_ops=saved_ops)
    for m in (model, plain):
        for block in m.h:
            block.compile(backend=TRACE_ONLY)
    ref_losses, ref_grads = train(plain, inputs, loss_fn, steps=2)
    losses, grads = train(model, inputs, loss_fn, steps=2)
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    assert max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads) <= ATOL
    assert remat.checkpointed_modules(model) == units


def compiled_baseline(model, inputs, loss_fn, **kw) -> int:
    """The measured compiled peak of the step without checkpointing (remat's plan for a roomy budget)."""
    plan = remat.optimize_checkpointing(model, 1.0, inputs, loss_fn=loss_fn, **kw)
    assert plan.checkpointed == () and plan.compiled
    return plan.checked_peak_bytes


@needs_compiled_floor
def test_optimize_checkpointing_on_a_compiled_model():
    """A model already wrapped by torch.compile is planned on the module it wraps (profiled eagerly) for its
    compiled step, and recompiles with the plan; names stay those of the user's model. (A batch large enough
    that checkpointing frees more than the 5 KB RNG state each checkpointed call saves.)"""
    model, inputs, loss_fn, _, _ = sequential_with_batchnorm(batch=512)
    plain = torch.compile(copy.deepcopy(model), backend=TRACE_ONLY)
    compiled = torch.compile(model, backend=TRACE_ONLY)
    trace_only = {"backend": TRACE_ONLY}
    budget = compiled_baseline(compiled, inputs, loss_fn, compile=trace_only) - 1
    # detected, with the settings the model was compiled with, read from it (measured with torch.compile's
    # defaults, inductor, before)
    plan = remat.optimize_checkpointing(compiled, budget / 2**30, inputs, loss_fn=loss_fn, granularity="block")
    assert plan.checked_peak_bytes <= budget and "torch.compile of the whole model" in plan.compiled
    assert "backend='aot_eager'" in plan.compiled and "its settings read from it" in plan.compiled, plan.compiled
    assert plan.checkpointed and remat.checkpointed_modules(compiled) == list(plan.checkpointed)
    assert not any(n.startswith("_orig_mod") for n in plan.checkpointed)
    ref_losses, ref_grads = train(plain, inputs, loss_fn, steps=1)
    losses, grads = train(compiled, inputs, loss_fn, steps=1)
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    assert max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads) <= ATOL
    assert remat.remove_checkpointing(compiled) == list(plan.checkpointed)


# -- plans for the compiled step (Note [Compiled steps] in remat.solve.calibrated) -------------------------------
def compiled_step_peak(model, inputs, loss_fn, optimizer=None) -> int:
    """The peak of one whole compiled step of ``model`` (already compiled, warmed up here): parameters, buffers,
    the batch and the optimizer state alive before it, plus what the step allocates (the profiler's
    allocator-level memory events), measured independently of remat's own meter."""
    from remat._compat import profiler_memory_peak
    from remat.runtime.measure import tensor_bytes

    args, kwargs = remat.runtime.measure.split_inputs(inputs)

    def step():
        loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        for p in model.parameters():
            p.grad = None

    torch.manual_seed(0)
    step()  # compiles; the optimizer state exists from here on
    state = [*model.parameters(), *model.buffers(), *remat.runtime.measure.input_tensors(args, kwargs)]
    if optimizer is not None:
        state += [t for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    return tensor_bytes(state) + profiler_memory_peak(step, torch.device("cpu"))


@needs_compiled_floor
def test_blocks_compiled_in_place_are_planned_compiled_and_keep_their_compile():
    """torchtitan's order: ``Module.compile()`` on each block, then remat (detected, with the settings the blocks
    were compiled with, read from them): profiled eagerly, planned on compiled steps of the blocks, and the blocks
    are still compiled afterwards (their own compiled calls); BatchNorm statistics and gradients equal the
    compiled plain model's. (When the settings were not read, remat compiled its candidates with inductor,
    torch.compile's default: 16 s of the suite with a cold inductor cache.)"""
    model, inputs, loss_fn, _, _ = sequential_with_batchnorm(batch=512)
    model = nn.Sequential(*(Layers(*model[i:i + 4]) for i in range(0, 12, 4)), model[12])
    plain = copy.deepcopy(model)
    for m in (model, plain):
        for block in m[:3]:
            block.compile(backend=TRACE_ONLY)
    impls = [block._compiled_call_impl for block in model[:3]]
    trace_only = {"backend": TRACE_ONLY}
    budget = compiled_baseline(model, inputs, loss_fn, compile=trace_only) - 1
    plan = remat.optimize_checkpointing(model, budget / 2**30, inputs, loss_fn=loss_fn, granularity="block")
    assert "3 submodules in place" in plan.compiled and "backend='aot_eager'" in plan.compiled
    assert "their settings read from them" in plan.compiled, plan.compiled
    assert plan.checkpointed and plan.checked_peak_bytes <= budget
    assert [block._compiled_call_impl for block in model[:3]] == impls
    ref_losses, ref_grads = train(plain, inputs, loss_fn, steps=2)
    torch._dynamo.utils.counters.clear()
    losses, grads = train(model, inputs, loss_fn, steps=2)
    # the loop's own compiled calls still compile after remat ran (Dynamo skips for good a code object it first
    # met under a dispatch mode, pytorch#190286: remat's recorder is one, and runs the blocks eagerly)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    assert max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads) <= ATOL
    for (n, b), (_, ref) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.allclose(b, ref, atol=ATOL), n


def test_compile_argument_is_checked():
    model, inputs, loss_fn, _, _ = sequential_with_batchnorm()
    with pytest.raises(remat.InvalidInputError, match="torch.compile settings"):
        remat.optimize_checkpointing(model, 1.0, inputs, loss_fn=loss_fn, compile={"mdoe": "max-autotune"})
    with pytest.raises(remat.InvalidInputError, match="compile must be"):
        remat.optimize_checkpointing(model, 1.0, inputs, loss_fn=loss_fn, compile="inductor")
    assert remat.checkpointed_modules(model) == []


def kept_operators(model, inputs, loss_fn, backend=None, randoms: list | None = None):
    """Per pass of each selective policy over its unit (one eagerly, one per trace under compile), the operators
    it keeps, each as (position among the operators that allocate in both eager and compiled code, overload):
    views, in-place and random operators and a dropout's mask product, which eager CPU and compile run
    differently (Note [Operators named alike under compile] in remat.rewrite), are left out of the count.
    With ``randoms`` (a list), also each random operator's (overload, decision), appended to it."""
    from torch.utils import checkpoint as ckpt

    passes: list[list] = []
    real = ckpt.create_selective_checkpoint_contexts

    def spying(policy, *a, **kw):
        seen: list = [0, []]
        passes.append(seen[1])
        noise: set[int] = set()

        def spy(ctx, func, *args, **kwargs):
            decision = policy(ctx, func, *args, **kwargs)
            random = remat.rewrite.draws_random(func, args, kwargs)
            if random:
                noise.update(remat._compat.storage_key(t) for t in args[:1] if func._schema.is_mutable)
            product = bool(noise) and func is torch.ops.aten.mul.Tensor and any(
                torch.is_tensor(t) and remat._compat.storage_key(t) in noise for t in args)
            skip = random or product or func._schema.is_mutable or str(func) in (
                "aten._unsafe_view.default", "aten.empty_like.default") or any(
                r.alias_info is not None for r in func._schema.returns)
            if random:
                if randoms is not None:
                    randoms.append((str(func), decision))
            elif decision == ckpt.CheckpointPolicy.MUST_SAVE:
                seen[1].append((seen[0], str(func)))
            seen[0] += 0 if skip else 1
            return decision

        return real(spy, *a, **kw)

    ckpt.create_selective_checkpoint_contexts = spying
    try:
        args, kwargs = remat.runtime.measure.split_inputs(inputs)
        run = model if backend is None else torch.compile(model, backend=backend)
        loss_fn(run(*args, **kwargs)).backward()
    finally:
        ckpt.create_selective_checkpoint_contexts = real
    return passes if randoms is None else (passes, randoms)


@needs_compiled_floor
def test_selective_policy_keeps_the_same_operators_under_compile():
    """A selective unit keeps, under torch.compile, the operators its plan names in the eager forward: the
    GPT attention's every-keepable-operator option, with a dropout between the softmax and the second matmul
    (eager CPU: empty_like, bernoulli_, div_, mul; compile: native_dropout). Before remat named operators alike
    in both (the mask's product was a keepable ``aten.mul.Tensor#0``), compile found no such mul and kept
    fewer operators than the plan (this test failed)."""
    profile = _two_block_profile()
    model, inputs, loss_fn = two_block_gpt()
    loss_fn = loss_fn or remat.default_loss
    option = max((u for u in profile.units if u.name.startswith("h.1.attn@ops")), key=lambda u: len(u.saved_ops))
    checkpoint_modules(model, [option.name], saved_ops={option.name: option.saved_ops})
    from torch.utils import checkpoint as ckpt

    eager, eager_random = kept_operators(model, inputs, loss_fn, randoms=[])
    compiled, compiled_random = kept_operators(model, inputs, loss_fn, backend=TRACE_ONLY, randoms=[])
    assert len(eager) == 1 and len(eager[0]) == len(option.saved_ops) >= 3
    assert compiled and all(p == eager[0] for p in compiled), (eager, compiled)
    # the dropout: drawn again in the eager recomputation, kept under compile (Note [Random operators under
    # compile] in remat.rewrite)
    assert eager_random and {d for _, d in eager_random} == {ckpt.CheckpointPolicy.PREFER_RECOMPUTE}
    assert compiled_random and {d for _, d in compiled_random} == {ckpt.CheckpointPolicy.MUST_SAVE}


class Layers(nn.Sequential):
    """An ``nn.Sequential`` with a forward of its own, as a user's block class has: ``Module.compile()`` compiles
    it. On torch.nn's own ``nn.Sequential`` it compiles nothing in this torch (Dynamo skips torch.nn's forwards
    as top frames: test_blocks_whose_module_compile_compiles_nothing_are_planned_eager_and_stay_eager)."""

    def forward(self, x):
        for layer in self:
            x = layer(x)
        return x


def conv_net(batch: int = 8, block_class: type = Layers):
    """Two conv blocks with BatchNorm (to be compiled in place) and a head."""
    torch.manual_seed(0)

    def block(cin, cout):
        return block_class(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                           nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

    model = nn.Sequential(block(3, 16), block(16, 16), nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
    return model, torch.randn(batch, 3, 16, 16), lambda out: out.square().mean()




@needs_compiled_floor
def test_the_settings_a_model_was_compiled_with_are_read_back():
    """remat measures a detected compiled step with the settings the loop compiled it with, read from Dynamo's
    objects (torch.compile is lazy: nothing is compiled here); None where there is nothing to read."""
    from remat._compat import compile_settings

    def layer():
        return nn.Linear(2, 2)

    def backend(gm, example_inputs):
        return gm

    assert compile_settings(torch.compile(layer(), backend="aot_eager")) == {"backend": "aot_eager"}
    assert compile_settings(torch.compile(layer(), backend="aot_eager", fullgraph=True, dynamic=False)) == {
        "backend": "aot_eager", "fullgraph": True, "dynamic": False}
    assert compile_settings(torch.compile(layer())) == {}  # inductor, its defaults
    assert compile_settings(torch.compile(layer(), mode="max-autotune-no-cudagraphs"))["options"]["max_autotune"]
    assert compile_settings(torch.compile(layer(), backend=backend)) == {"backend": backend}
    block = layer()
    block.compile(backend="aot_eager", dynamic=True)
    assert compile_settings(block._compiled_call_impl) == {"backend": "aot_eager", "dynamic": True}
    assert compile_settings(layer()) is None and compile_settings(lambda x: x) is None


def _module_compile_of_sequential_compiles() -> bool:
    """Whether ``Module.compile()`` on torch.nn's own ``nn.Sequential`` compiles anything in this torch, seen as
    the loop sees it: one step of a compiled block, Dynamo's graph counter read after it (pytorch#150915: on
    torch 2.13 it counts none; 2.14 and 2.15 compile the block). Independent of remat's own probe
    (remat._compat.module_compile_compiles_nothing), which the test below holds to it."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    block.compile(backend=TRACE_ONLY)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    block(torch.randn(2, 4)).sum().backward()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs > 0


def test_blocks_whose_module_compile_compiles_nothing_are_planned_eager_and_stay_eager():
    """``Module.compile()`` on a block that is one of torch.nn's own modules (here ``nn.Sequential``) compiles
    nothing in some torch releases (2.13): Dynamo skips ``Module._call_impl`` and those modules' forwards (their
    files are in its skip rules; pytorch#150915), so the loop runs the blocks eagerly. remat plans that eager step
    (predicted = checked), says why in the plan, and its checkpointing keeps the blocks eager. Before, remat's
    installed forward was a frame Dynamo captures: the checkpointed blocks compiled (a graph per block) and the
    others did not, and remat planned it as a compiled loop, calibrating on that mix (the conv net's prediction
    was 4-14% off). Where the release compiles such blocks (2.14, 2.15), remat plans the compiled loop the
    blocks are, with no such note, and the step after remat compiles. Which case holds is seen, not assumed
    (:func:`_module_compile_of_sequential_compiles`)."""
    compiles = _module_compile_of_sequential_compiles()
    model, inputs, loss_fn = conv_net(block_class=nn.Sequential)
    for block in model[:2]:
        block.compile(backend=TRACE_ONLY)
    impls = [block._compiled_call_impl for block in model[:2]]
    planner = remat.Planner(remat.make_profile(model, inputs, loss_fn=loss_fn), granularity="block")
    budget = (planner.min_peak_bytes + planner.baseline_peak_bytes) // 2
    plan = remat.optimize_checkpointing(model, budget / 2**30, inputs, loss_fn=loss_fn, granularity="block")
    assert plan.checkpointed and plan.checked_peak_bytes <= budget
    torch._dynamo.utils.counters.clear()
    loss_fn(model(inputs)).backward()  # the loop's step, after remat
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if compiles:
        assert plan.compiled != "" and not any("compiles nothing" in n for n in plan.notes), (plan.compiled,
                                                                                               plan.notes)
        assert graphs > 0
    else:
        assert plan.compiled == "", plan.compiled
        assert plan.checked_peak_bytes == plan.predicted_peak_bytes
        assert any("compiles nothing" in n and "'0', '1'" in n for n in plan.notes), plan.notes
        assert graphs == 0
    remat.remove_checkpointing(model)
    assert [block._compiled_call_impl for block in model[:2]] == impls


def test_a_failure_after_the_rewrite_gives_the_compiled_calls_back(monkeypatch):
    """remat's work undone on failure includes the compiled calls it set aside (Note [Blocks Module.compile()
    leaves eager] in remat.rewrite): a failure after the plan was installed leaves each block's compiled call
    and nothing checkpointed. (Before, the snapshot put the forwards back but not the compiled calls: both
    blocks were left with none.)"""
    import remat.api.optimize

    model, inputs, loss_fn = conv_net(block_class=nn.Sequential)
    for block in model[:2]:
        block.compile(backend=TRACE_ONLY)
    impls = [block._compiled_call_impl for block in model[:2]]
    real = remat.api.optimize.checkpoint_plan

    def installed_then_failed(m, plan):
        real(m, plan)
        raise RuntimeError("a failure after the rewrite")

    monkeypatch.setattr(remat.api.optimize, "checkpoint_plan", installed_then_failed)
    planner = remat.Planner(remat.make_profile(model, inputs, loss_fn=loss_fn), granularity="block")
    budget = (planner.min_peak_bytes + planner.baseline_peak_bytes) // 2
    with pytest.raises(remat.InternalError, match="rewrite"):
        remat.optimize_checkpointing(model, budget / 2**30, inputs, loss_fn=loss_fn, granularity="block", check=False)
    assert [block._compiled_call_impl for block in model[:2]] == impls
    assert remat.checkpointed_modules(model) == [] and left_eager(model) == []
