"""The memory helpers of the layer-by-layer passes (``torq.models.streaming``)."""

from __future__ import annotations

import gc
import weakref

from torq.models.streaming import collecting_new_objects_only, give_back_memory


class _Cycle:
    """An object in a reference cycle: only the garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_a_pass_collects_what_it_made_and_leaves_older_objects_for_after() -> None:
    """A pass starts with one full collection (older garbage goes then); inside it the
    collection after each layer frees the cycles the pass made, while objects alive when it
    began are out of the collector's sight until it ends; nested passes freeze once;
    afterwards nothing stays frozen and a collection frees the rest."""
    before_garbage, kept = _Cycle(), {"obj": _Cycle()}
    garbage_ref, kept_ref = weakref.ref(before_garbage), weakref.ref(kept["obj"])
    del before_garbage
    seen: dict[str, object] = {}

    @collecting_new_objects_only
    def inner() -> int:
        return 7

    @collecting_new_objects_only
    def layer_pass() -> int:
        seen["frozen"] = gc.get_freeze_count()
        seen["garbage_freed_at_start"] = garbage_ref() is None
        new = _Cycle()
        new_ref = weakref.ref(new)
        del new
        del kept["obj"]  # alive when the pass began: frozen, so not collected in it
        give_back_memory()
        seen["new_freed"] = new_ref() is None
        seen["old_kept"] = kept_ref() is not None
        made_in_pass = [0]  # tracked by the collector, alive across the nested pass
        assert inner() == 7
        # a second freeze would have moved it out of the collector's sight. (The frozen
        # count is not compared: frozen objects freed by their reference count leave it.)
        seen["nested_did_not_freeze"] = any(o is made_in_pass for o in gc.get_objects())
        return 1

    gc.disable()  # no automatic collection in between: only the pass's own
    try:
        assert garbage_ref() is not None
        assert layer_pass() == 1
    finally:
        gc.enable()
    assert seen["garbage_freed_at_start"] is True
    assert seen["frozen"] > 0 and seen["new_freed"] is True and seen["old_kept"] is True
    assert seen["nested_did_not_freeze"] is True
    assert gc.get_freeze_count() == 0  # everything given back to the collector
    gc.collect()
    assert kept_ref() is None
