"""`grpo-run --plan`: the rollout decode compiled as the run executes it, in the layout the run
takes (grpo_rollout.gather), then each earlier segment of a segmented decode
(grpo_rollout.segments) in that layout.

The layout is chosen on the last segment, the one whose view is the whole cache: it is the
decode's largest program (the memory check) and its per-step cost is the highest, so the layouts
are ranked at their most expensive step. The earlier segments are compiled in the chosen layout
only and recorded as phases `rollout decode steps A-B`, which the projection prices for their steps.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax

from grpo_core.contracts import PhaseCompiler
from grpo_rollout.collectives import decode_traffic_note
from grpo_rollout.decode import decode, loop_shardings
from grpo_rollout.gather import (bytes_beyond_arguments, candidate_layouts, compile_unless_unsupported, fastest_layout,
                                 gather_refused_note, has_sharded_weights, layout_static)
from grpo_rollout.segments import decode_phase_name, segment_ranges, segmented_seconds


def compile_decode(compiler: PhaseCompiler, args: tuple, static: dict[str, Any], gather_option: Any,
                   segments: int) -> None:
    """Records `rollout decode` (the last segment, or the whole decode) and the earlier segments."""
    chosen = compile_last_segment(compiler, args, static, gather_option, segments)
    if chosen is None or segments == 1:
        return
    args = compile_lay_out(compiler, args, chosen)
    if compiler.compile("rollout decode", lambda: decode.lower(*args, **chosen).compile(), args) is None:
        return  # the last segment again, now as the run calls it: on the laid-out weights and cache
    for first, end in segment_ranges(static["params"].max_new_tokens, segments)[:-1]:
        program = compiler.compile(decode_phase_name(first, end),
                                   lambda end=end: decode.lower(*args, **chosen, until=end).compile(), args,
                                   note=f"decode steps {first}-{end - 1}: the cache read up to their last step")
        if program is None:
            return


def compile_lay_out(compiler: PhaseCompiler, args: tuple, chosen: dict[str, Any]) -> tuple:
    """Records `rollout decode layout` (the weights and cache moved into the decode's layout once,
    grpo_rollout.decode.lay_out) and returns the decode's arguments as the segments receive them."""
    weights, cache, state, key = args
    targets = loop_shardings(weights, cache, **chosen)
    compiler.compile("rollout decode layout", lambda: jax.jit(lambda w, c: (w, c), out_shardings=targets).lower(
        weights, cache).compile(), (weights, cache), note="the weights and cache moved into the decode's layout once")
    laid = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), (weights, cache), targets)
    return (*laid, state, key)


def compile_last_segment(compiler: PhaseCompiler, args: tuple, static: dict[str, Any], gather_option: Any,
                         segments: int = 1) -> Optional[dict[str, Any]]:
    """Records `rollout decode` in the layout the run takes; returns that layout's static arguments
    (None when the compiler refused it)."""
    def build(gather: bool) -> Callable[[], Any]:
        return lambda: decode.lower(*args, **{**static, "gather_weights": gather}).compile()

    auto_note = ""
    if gather_option == "auto" and has_sharded_weights(args[0]):
        layout = compile_fastest_decode(compiler, args, static, segments)
        if layout is not None:
            return layout
        gathered = compiler.compile("rollout decode", build(True), args, record=False)
        spare = None if gathered is None else compiler.spare_bytes(gathered)
        if spare is not None and bytes_beyond_arguments(gathered) <= spare:
            compiler.compile("rollout decode", lambda: gathered, args, note=lambda compiled: (
                "gather_weights=auto: weights gathered once per rollout (the copy fits); "
                + decode_traffic_note(compiled, True)))
            return {**static, "gather_weights": True}
        auto_note = gather_refused_note(gathered, spare)
    gather, split = static["gather_weights"], static["model_parallel"]
    layout = {True: "model-parallel weights (resharded once per rollout); ",
              "heads": "head-parallel weights (resharded once per rollout); ",
              "experts": "expert-parallel weights (resharded once per rollout); "}.get(split, "")
    program = compiler.compile("rollout decode", build(gather), args,
                               note=lambda compiled: auto_note + layout + decode_traffic_note(compiled, gather or split))
    return None if program is None else static


def compile_fastest_decode(compiler: PhaseCompiler, args: tuple, static: dict[str, Any],
                           segments: int = 1) -> Optional[dict[str, Any]]:
    """With a chip to project for: records the fastest decode layout that fits (see
    grpo_rollout.gather.fastest_layout; each of `segments` calls pays its setup) and returns its
    static arguments; None without a chip."""
    steps = static["params"].max_new_tokens - 1

    def compile_layout(name: str) -> Any:
        return compiler.compile("rollout decode", lambda: compile_unless_unsupported(
            lambda: decode.lower(*args, **layout_static(static, name)).compile()), args, record=False)

    probe = compile_layout("sharded")
    if probe is None or compiler.decode_seconds(probe, steps) is None:
        return None

    def fits(program: Any) -> bool:
        spare = compiler.spare_bytes(program)
        return spare is not None and bytes_beyond_arguments(program) <= spare

    layout, chosen, note = fastest_layout(lambda name: probe if name == "sharded" else compile_layout(name), fits,
                                          lambda program: segmented_seconds(compiler.decode_seconds, program, steps,
                                                                            segments),
                                          candidate_layouts(static, args[0]), steps)
    compiler.compile("rollout decode", lambda: chosen, args,
                     note=lambda compiled: f"{note}; " + decode_traffic_note(compiled, layout != "sharded"))
    return layout_static(static, layout)
