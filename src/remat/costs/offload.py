"""Offloading in the memory model: what moving a unit's saved activations to host memory does to the step's
memory and time, as linear functions of the plan (issue #50; no torch).

Note [Offload in the memory model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An offloaded unit (Note [Offloaded units] in remat.rewrite.offload) frees what checkpointing it would free, its
drops (saved only inside it, made in its forward), without recomputing anything, and with two differences of
timing, both predicted on the high side:

* a drop leaves the device once its copy out has completed: at the end of the forward of the unit after it at
  its level by which the units after it have run forward as long as the copy takes (bytes over the link's
  bandwidth; Note [Offload streams]); a unit whose copy would still run when the backward starts is not offered;
* the drops come back when the next unit's backward starts (the mechanism prefetches one unit ahead where that
  unit is offloaded too), not at the unit's own backward: from that index they are alive again (predicted high where
  the next unit is not offloaded: then they come back at the unit's own backward); what the unit's backward waits
  for them is Note [Exposed copies]. No recomputation row: nothing runs again. Storages under
  :data:`MIN_OFFLOAD_BYTES` stay on the device, as the mechanism leaves them.

So an offload variable ``offload:u`` is one more 0/1 choice whose coefficient at index ``i`` is minus the bytes
of ``u``'s drops with ``free_at <= i < back_at``. Offered for a whole module called once per step (not a
segment, region or selective unit); offloading ``u`` excludes checkpointing ``u`` or anything inside or around it
(the ILP's overlap cliques count the offload variable with ``u``'s span).

Note [Offloaded parts]
~~~~~~~~~~~~~~~~~~~~~~
A unit's drops need not all go: each drop records the operator of the unit's forward that made it
(``Drop.op``, named as a selective policy names operators), and a *part* ``offload:u~k`` moves only the
largest of them, up to a share of the unit's offloadable bytes (:data:`PART_SHARES`), the rest staying on the
device. A part's copy is shorter, so it leaves the device sooner and is more often hidden: a Llama layer's
3.25 GiB take 52 ms over an H100's link against the next layer's 20 ms forward, its largest operator outputs
less. Parts are options of the unit as selective policies are options of a checkpoint: in the unit's cliques,
at most one of them, the whole unit's offload or a checkpoint. The mechanism moves the storages the named
operators made and no other (``Offloader`` with ``ops``, in remat.rewrite.offload).

Time: Note [Exposed copies]. Host memory: the offloaded bytes at once, within ``HostLink.host_bytes``.

Note [Exposed copies]
~~~~~~~~~~~~~~~~~~~~~
Every offloaded byte crosses the host link once each way, device to host in the forward, host to device in the
backward, each at the rate measured for its direction (``HostLink``; the H200's 54.5 GB/s host to device against
PCIe Gen5's nominal 63.0, docs/offload.md). The copies run on one side stream, in the order they are issued, and
overlap only compute of the pass they are issued in; the step's other work does not use that stream or the link
(FSDP's collectives go over NVLink), so nothing else competes with them. What is exposed, by what the mechanism
does (Note [Offloaded units] in remat.rewrite.offload), not by one window per pass:

* out: a unit's copies start with its forward (``OffloadSpan.start_s``) and queue behind those of the units
  before it; what the queue has not finished when the backward starts is paid:
  ``max(0, max over chosen k of (start_k + sum of copy_out_s of the chosen units from k on) - forward_s)``;
* back: a unit's storages are brought back when the backward of the next unit starts where that unit is offloaded
  too (one unit ahead: the next candidate at its level in the order the recorded step ran them, ``layers.4`` after
  ``layers.3``, a block's MLP after its attention), else at its own first use. The pairing is decided here, from
  the recording, and carried by the plan (``Plan.offload_ahead``), which the mechanism installs as it is (issue
  #62: it was once re-derived at apply time from the names, ``layers.N`` and ``layers.N+1``, which left siblings
  registered in another order than they run unpaired). So with its next unit (``OffloadSpan.next_unit``) offloaded
  too, its wait is what the next unit's backward does not hide (``paired_stall_s``); with the next unit kept or
  recomputed nothing brings it back early and its backward waits for the whole copy (``stall_s = copy_back_s``). Measured on the H200 (torchtitan's Llama, 4 layers, the first offloaded and the
  other three recomputed, so nothing ahead of it: the case of ``stall_s``): 447-451 ms a step where every layer
  recomputed took 405; the old model, which let the next layer's backward hide the copy back whatever that layer
  did, predicted no wait at all (361 ms).

Both are in the ILP (remat.solve.ilp): a row per offload option for the queue out, and per option a continuous
``z`` (at most its own variable and the sum of its next unit's options) that takes ``stall_s - paired_stall_s``
off the objective. So an offload is chosen only where its copies' exposed time is below the recompute it
replaces, on the same device model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remat.costs.unit_costs import Profile, UnitCost, is_selective

#: the least bytes a saved storage needs to be offloaded (smaller ones stay: Note [Offloaded units] in
#: remat.rewrite.offload)
MIN_OFFLOAD_BYTES = 64 * 1024

#: the prefix of an offload variable's name: ``offload:h.3`` (Note [Offload in the memory model])
OFFLOADED = "offload:"


#: what names an offload of some of a unit's operators: ``offload:h.3~1``, the first of ``h.3``'s parts
PART = "~"
#: the parts offered per unit: its largest offloadable operator outputs up to these shares of its bytes
PART_SHARES = (0.25, 0.5, 0.75)


def offload_key(unit: str, part: int = 0) -> str:
    return OFFLOADED + unit + (f"{PART}{part}" if part else "")


def offloaded_choice(variable: str) -> str | None:
    """What a plan lists as offloaded for an offload variable: ``"h.3"`` for ``"offload:h.3"``, ``"h.3~1"`` for a
    part; None for any other plan variable."""
    return variable[len(OFFLOADED):] if variable.startswith(OFFLOADED) else None


def offloaded_module(choice: str) -> str:
    """The module a plan's offloaded entry names: ``"h.3"`` for ``"h.3"`` and for its part ``"h.3~1"``."""
    return choice.split(PART)[0]


def offloaded_unit(variable: str) -> str | None:
    """The module an offload variable moves activations of: ``"h.3"`` for ``"offload:h.3"`` and
    ``"offload:h.3~1"``; None for any other plan variable."""
    choice = offloaded_choice(variable)
    return None if choice is None else offloaded_module(choice)


@dataclass(frozen=True)
class HostLink:
    """What offloading costs where the step runs: the host link's bandwidth in each direction (bytes/s, as the
    copy engine moves them), the host memory one device may fill (None: unlimited), and where they come from."""

    to_host_bytes_per_s: float
    to_device_bytes_per_s: float
    host_bytes: int | None = None
    source: str = ""


def link_from_spec(spec: Any, *, host_bytes: int | None = None, carried_from: Any = None) -> HostLink:
    """The :class:`HostLink` of a device spec (remat.target.devices.DeviceSpec, read by its fields): each
    direction's measured pinned copy rate (``device_to_host_bytes_per_s``, ``host_to_device_bytes_per_s``); a
    direction not measured takes the other's where that was (the link is the same both ways); with neither, the
    nominal ``host_link_bytes_per_s`` times the share of its nominal rate that ``carried_from`` (a measured
    device) reached, each direction's share where measured; else the nominal rate. ``source`` says which."""
    nominal = spec.host_link_bytes_per_s
    out, back = spec.device_to_host_bytes_per_s, spec.host_to_device_bytes_per_s
    name = getattr(spec, "name", "?")
    if out or back:
        how = {"to host": "measured" if out else "not measured: the other direction's",
               "to device": "measured" if back else "not measured: the other direction's"}
        out, back = out or back, back or out
    elif carried_from is not None and carried_from.host_link_bytes_per_s and (
            carried_from.device_to_host_bytes_per_s or carried_from.host_to_device_bytes_per_s):
        ref = link_from_spec(carried_from)
        share_out = ref.to_host_bytes_per_s / carried_from.host_link_bytes_per_s
        share_back = ref.to_device_bytes_per_s / carried_from.host_link_bytes_per_s
        out, back = nominal * share_out, nominal * share_back
        how = {"to host": f"not measured: {share_out:.0%} of the nominal rate, carried from {carried_from.name}",
               "to device": f"not measured: {share_back:.0%} of the nominal rate, carried from {carried_from.name}"}
    else:
        out = back = nominal
        how = {"to host": "nominal, not measured", "to device": "nominal, not measured"}
    source = (f"{name}'s host link, {out / 1e9:.1f} GB/s to host ({how['to host']}), {back / 1e9:.1f} GB/s to "
              f"device ({how['to device']})")
    return HostLink(float(out), float(back), host_bytes=host_bytes, source=source)


@dataclass(frozen=True)
class OffloadSpan:
    """When an offloaded unit's drops are gone: ``(nbytes, free_at, storage)`` each, back at ``back_at``; and what
    its copies take (Note [Exposed copies])."""

    unit: str
    drops: tuple[tuple[int, int, int | None], ...]
    back_at: int
    #: seconds the unit's backward waits for its copy back when the unit after it is not offloaded (nothing
    #: brings it back early: the whole copy back)
    stall_s: float = 0.0
    #: the operators whose outputs a part moves (``aten.mm.default#1``); empty: every storage of the unit's
    ops: tuple[str, ...] = ()
    #: seconds it waits when ``next_unit`` is offloaded too (what that unit's backward does not hide)
    paired_stall_s: float = 0.0
    #: the next unit at its level in the recorded step's order, whose offloaded backward brings this one's storages
    #: back (Note [Exposed copies]); None: no such unit
    next_unit: str | None = None
    #: when its forward starts, seconds into the step's forward (its copies out start then at the earliest)
    start_s: float = 0.0
    #: seconds its copies out take, at the link's rate to the host (back: ``stall_s``, all of it waited for)
    copy_out_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(b for b, _, _ in self.drops)

    def freed_at(self, index: int) -> int:
        """Bytes the offload removes from memory at timeline ``index``."""
        return sum(b for b, at, _ in self.drops if at <= index < self.back_at) if index < self.back_at else 0

    def gone_at(self, index: int) -> set[int]:
        """The recorded storages the offload has removed at ``index``."""
        return {s for _, at, s in self.drops if s is not None and at <= index < self.back_at}

    def cuts(self) -> set[int]:
        return {at for _, at, _ in self.drops} | {self.back_at}


def offloadable_units(profile: Profile, units: dict[str, UnitCost], link: HostLink,
                      parts: bool = True) -> dict[str, OffloadSpan]:
    """Per candidate unit that may be offloaded over ``link``, its :class:`OffloadSpan` (Note [Offload in the memory
    model]): its drops of at least :data:`MIN_OFFLOAD_BYTES` (smaller ones stay on the device), gone once the units
    after it at its level have run forward long enough to copy them out, back when the next one's backward
    starts; a unit whose copy out cannot finish before the backward starts is not offered. Beside the whole unit,
    its parts (Note [Offloaded parts]): its largest operator outputs up to each of :data:`PART_SHARES` of its
    bytes, each one more option of the unit (with ``parts``)."""
    siblings: dict[str | None, list[UnitCost]] = {}
    for u in profile.units:
        if not (u.is_segment or u.is_region or is_selective(u.name)) and u.recompute_at is not None:
            siblings.setdefault(u.parent, []).append(u)
    out = {}
    for name, u in units.items():
        if u.is_segment or u.is_region or is_selective(name) or u.later_calls or u.recompute_at is None:
            continue
        drops = [d for d in u.drops if d.nbytes >= MIN_OFFLOAD_BYTES]
        after = sorted((v for v in siblings.get(u.parent, ()) if v.forward_start > u.forward_end),
                       key=lambda v: v.forward_start)
        options = [((), drops)]
        named = sorted((d for d in drops if d.op is not None), key=lambda d: (-d.nbytes, d.op))
        total = sum(d.nbytes for d in drops)
        for share in PART_SHARES if parts else ():
            part, acc = [], 0
            for d in named:
                if part and acc + d.nbytes > share * total:
                    break
                part.append(d)
                acc += d.nbytes
            ops = tuple(sorted({d.op for d in part}))
            if part and acc < total and all(ops != o for o, _ in options):
                options.append((ops, part))
        for k, (ops, chosen) in enumerate(options):
            span = _span(profile, name, u, chosen, after, link, ops)
            if span is not None:
                out[offload_key(name, k)] = span
    return out


def _span(profile: Profile, name: str, u: UnitCost, drops: list, after: list[UnitCost], link: HostLink,
          ops: tuple[str, ...]) -> OffloadSpan | None:
    """The span of offloading ``drops`` of unit ``u`` (all of them, or a part: ``ops``), or None where their copy
    out would still run when the backward starts, or nothing would leave the device before it is needed."""
    moved = sum(d.nbytes for d in drops)
    copy_s, ran_s, gone = moved / link.to_host_bytes_per_s, 0.0, None
    for v in after:
        ran_s += v.forward_s
        if ran_s >= copy_s:
            gone = v.forward_end + 1
            break
    if gone is None:
        # after the last unit at its level: the rest of the forward (the head, the loss), as a share of the step
        rest_s = profile.forward_s * (profile.backward_start - u.forward_end) / max(profile.backward_start, 1)
        if ran_s + rest_s < copy_s:
            return None  # its copy would still run when the backward starts: not offered
        gone = profile.backward_start
    # Note [Exposed copies]: what brings it back early is the next unit at its level in the recorded order, where it
    # is offloaded too (the plan carries the pairing, Plan.offload_ahead; remat.rewrite.offload installs it)
    nxt = after[0] if after else None
    back = min(nxt.recompute_at, u.recompute_at) if nxt is not None else u.recompute_at
    spans = tuple((d.nbytes, max(d.free_from, min(gone, back)), d.storage) for d in drops)
    if not spans or not any(at < back for _, at, _ in spans):
        return None
    # Note [Exposed copies]: brought back while the next unit's backward runs where that unit is offloaded too
    # (one unit ahead), what that does not hide waited for; else the whole copy back waited for
    back_s = moved / link.to_device_bytes_per_s
    window = (nxt.backward_s if nxt.backward_s is not None else 2 * nxt.forward_s) if nxt else 0.0
    start_s = profile.forward_s * u.forward_start / max(profile.backward_start, 1)
    return OffloadSpan(name, spans, back, back_s, ops, paired_stall_s=max(0.0, back_s - window),
                       next_unit=nxt.name if nxt is not None else None, start_s=start_s, copy_out_s=copy_s)


def exposed_copy_s(spans: dict[str, OffloadSpan], forward_s: float) -> float:
    """Seconds of the chosen offloads' copies (``spans``, by variable) not hidden behind compute (Note [Exposed
    copies]): the copies out the forward has not finished, and each unit's wait for its copy back, shorter where
    the unit after it is offloaded too."""
    if not spans:
        return 0.0
    chosen = sorted(spans.values(), key=lambda s: s.start_s)
    queue_end = max(s.start_s + sum(v.copy_out_s for v in chosen if v.start_s >= s.start_s) for s in chosen)
    offloaded = {s.unit for s in chosen}
    waits = sum(s.paired_stall_s if s.next_unit in offloaded else s.stall_s for s in chosen)
    return max(0.0, queue_end - forward_s) + waits
