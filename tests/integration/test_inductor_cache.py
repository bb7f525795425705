"""remat's reading of inductor's cache (Note [Compiled programs] in remat.costs.compiled_memory): an entry with the sizes
remat kept is found before an older one without them. No compile: entries written by hand."""

from __future__ import annotations

import os
import pickle
import types

from torch._inductor.codecache import FxGraphCache

from remat._compat import inductor as compat_inductor
from remat._compat import inductor_programs
from helpers import needs_compiled_floor


@needs_compiled_floor
def test_an_entry_with_kept_sizes_is_found_before_an_older_one_without(tmp_path, monkeypatch):
    """Inductor reads one graph's entries in name order and takes the first whose guards pass. An entry cached by
    a process that did not read it (no sizes kept) found first made every remat compile of that step lower it
    again, or trace it again through AOTAutograd's cache (the tests' GPT compiled per block: 2.6-2.8 s per call
    against 1.8 s once the entry with kept sizes is found first)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(compat_inductor._PROGRAM_SIZES, "kept-key", {"buf0": 64})
    subdir = FxGraphCache._get_tmp_dir_for_key("fgraph")
    assert subdir.startswith(str(tmp_path))  # this test's cache directory, not the machine's
    os.makedirs(subdir, exist_ok=True)
    for name, key in (("a-older", "stale-key"), ("b-newer", "kept-key")):
        with open(os.path.join(subdir, name), "wb") as f:
            pickle.dump(types.SimpleNamespace(cache_key=key, guards_expr=None), f)

    def first() -> str:
        return next(FxGraphCache.iterate_over_candidates(True, None, "fgraph"))[0].cache_key

    assert first() == "stale-key"  # inductor's own order
    with inductor_programs():
        assert first() == "kept-key"
        assert [c.cache_key for c, _, _ in FxGraphCache.iterate_over_candidates(True, None, "fgraph")] == \
            ["kept-key", "stale-key"]  # the other still there, after it
    assert first() == "stale-key"  # inductor's order back afterwards
    assert "iterate_over_candidates" not in FxGraphCache.__dict__
