"""What `autosymm run` says on a machine without a CUDA GPU, in a screenful: that nothing is tuned
here, what this machine would run (the dispatcher's decision for one representative call of each
registered op: untuned, so each op's fallbacks), which hardware the shipped databases cover (one
line each: hardware, world sizes, ops, rows) and the next step.
"""

from __future__ import annotations

from typing import Optional

from .. import settings, spec
from ..problem import Problem
from ..spec import OpSpec, PointRequest
from .plans import Target, cannot_serve, offline_caps, tuned_hardware
from ..runtime.dispatch import decide

#: The calls `run` decides for this machine: bf16 on a group of this many ranks (the README's example's).
WORLD_SIZE = 2


def representative(record: OpSpec, world_size: int, dtype: str) -> Optional[Problem]:
    """One call of ``record``: its middle default size, with its first default shape (None: no point)."""
    sizes, shapes = record.points.sizes, record.points.shapes
    if not sizes or (record.shape and not shapes):
        return None
    request = PointRequest((dtype,), world_size, sizes=(sizes[len(sizes) // 2],),
                           shapes=shapes[:1] if record.shape else None, extra_sizes=False)
    return next(iter(record.problems(request)), None)


def decision_lines(target: Target, sources) -> list[str]:
    """One line per registered op: what a representative call would run on ``target`` (eager)."""
    caps, lines = offline_caps(target), []
    for record in spec.registered():
        problem = representative(record, target.world_size, target.dtype)
        if problem is None:
            continue
        decision = decide(problem, "eager", caps, sources, target.hardware, settings.deterministic())
        raises = cannot_serve(decision, problem, caps, "eager")
        what = f"raises ({raises[0]})" if raises else decision.backend
        if decision.tuned:
            what += f" (tuned row, {decision.source.rsplit('/', 1)[-1]})"
        elif decision.config is not None:
            what += " (its untuned default config)"
        label = f"{record.name} {record.point_label(problem, ' ')}{record.unit.label_suffix}"
        lines.append(f"  {label:36s} {what}")
    return lines


def coverage_lines(sources) -> list[str]:
    """One line per hardware the databases ``sources`` cover: its world sizes, ops and rows."""
    covered: dict[str, dict] = {}
    for source in sources:
        for row in source.db.rows():
            entry = covered.setdefault(row.hardware, {"gpu": row.gpu, "sizes": set(), "ops": set(), "rows": 0})
            entry["sizes"].add(row.world_size)
            entry["ops"].add(row.op)
            entry["rows"] += 1
    order = {name: i for i, name in enumerate(spec.names())}
    return [f"  {slug} ({entry['gpu']}): world size {', '.join(map(str, sorted(entry['sizes'])))}; "
            f"{', '.join(sorted(entry['ops'], key=lambda op: order.get(op, len(order))))}; {entry['rows']} rows"
            for slug, entry in sorted(covered.items())]


def overview(fingerprint, sources, shipped) -> list[str]:
    """`autosymm run`'s lines without a GPU: ``fingerprint`` this machine's
    (autosymm.hardware.Fingerprint), ``sources`` the databases the dispatcher reads here (user,
    shipped), ``shipped`` the shipped ones alone."""
    target = Target(fingerprint.hardware_slug, fingerprint.gpu_name, WORLD_SIZE, "bf16")
    tuned = target.hardware in tuned_hardware(sources)
    state = "tuned rows exist for it" if tuned else "untuned: every call takes its op's fallbacks"
    lines = ["autosymm run: no CUDA GPU here, so nothing was tuned (on a GPU node `autosymm run` is `autosymm tune`).",
             f"This machine: GPU {target.gpu!r}, hardware {target.hardware} ({state}).",
             f"What a bf16 call on {WORLD_SIZE} ranks of this machine would run (eager):",
             *decision_lines(target, sources),
             "Shipped tuning databases:" if shipped else "Shipped tuning databases: none found.",
             *coverage_lines(shipped), "Next:"]
    steps = [(f'autosymm explain --gpu "{gpu}" --world-size {min(sizes)} --all', f"a shipped plan ({slug})")
             for slug, (gpu, sizes) in sorted(tuned_hardware(shipped).items())][:2]
    plain = next((record for record in spec.registered() if not record.shape), None)
    problem = plain and representative(plain, WORLD_SIZE, "bf16")
    if problem is not None:
        steps.append((f"autosymm explain --op {plain.name} {plain.unit.option.flag} {plain.unit.cell(problem.bucket)} "
                      f"--world-size {WORLD_SIZE}", "one call, on this machine"))
    steps.append(("autosymm tune", "on a GPU node: tune that node"))
    width = max(len(command) for command, _ in steps)
    return lines + [f"  {command:{width}s}  # {comment}" for command, comment in steps]
