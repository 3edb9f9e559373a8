"""What the kernel-looping pass did, as data and as text (`jaxdecode loop-report` prints it)."""

from __future__ import annotations

import dataclasses


def aval_str(aval) -> str:
    """`f32[4,8]`-style text for an abstract value."""
    text = getattr(aval, "str_short", None)
    return text() if callable(text) else str(aval)


@dataclasses.dataclass
class InputReport:
    """One input position of the looped callee."""

    position: int
    label: str  # the callee's argument name, e.g. "state['mlp']['up']['kernel']"
    aval: str  # per call, e.g. "f32[8,16]"
    kind: str  # "carried" | "shared" | "stacked"
    source: str  # how the scan gets it, e.g. "from output 0", "packed: argument 0"


@dataclasses.dataclass
class RunReport:
    """One run of calls rewritten into one `lax.scan`."""

    callee: str
    length: int
    where: str  # path of the jaxpr holding the run, e.g. "fn/jit(decode)/cond.branches[1]"
    name_scope: str  # the scope the scan is emitted under, plus the per-call scope, e.g. "decoder/layers"
    inputs: list[InputReport]
    outputs: list[str]
    hoisted: int  # ops between calls moved before the scan
    sunk: int  # ops between calls moved after the scan

    def labels(self, kind: str) -> list[str]:
        return [i.label for i in self.inputs if i.kind == kind]

    @property
    def carried(self) -> list[str]:
        return self.labels("carried")

    @property
    def shared(self) -> list[str]:
        return self.labels("shared")

    @property
    def stacked(self) -> list[str]:
        return self.labels("stacked")


@dataclasses.dataclass
class SkipReport:
    """A call of a repeated callee that was not merged into the run before it."""

    callee: str
    where: str
    name_scope: str
    reason: str


@dataclasses.dataclass
class LoopReport:
    runs: list[RunReport]
    skips: list[SkipReport]
    index_mode: str
    notes: list[str] = dataclasses.field(default_factory=list)  # packing of arguments and outputs

    def to_dict(self) -> dict:
        """Plain JSON-ready data (`jaxdecode loop-report --json`)."""
        return dataclasses.asdict(self)

    def format(self) -> str:
        calls = sum(r.length for r in self.runs)
        lines = [
            f"kernel looping: {len(self.runs)} run(s) covering {calls} calls, "
            f"{len(self.skips)} call(s) not merged (index mode: {self.index_mode})"
        ]
        for n, run in enumerate(self.runs, 1):
            lines.append(
                f"run {n}: `{run.callee}` x{run.length} -> lax.scan(length={run.length})"
                f"  in {run.where}  scope '{run.name_scope}'"
            )
            width = max(len(i.label) for i in run.inputs)
            for kind in ("carried", "shared", "stacked"):
                for i in (i for i in run.inputs if i.kind == kind):
                    lines.append(f"  {kind:8s} in{i.position:<3d} {i.label:{width}s}  {i.aval:18s} {i.source}")
            lines += [f"  output   {o}" for o in run.outputs]
            if run.hoisted or run.sunk:
                lines.append(
                    f"  reordered: {run.hoisted} op(s) between calls hoisted before the scan, {run.sunk} sunk after it"
                )
        if self.skips:
            lines.append("not merged:")
            lines += [f"  `{s.callee}` in {s.where} scope '{s.name_scope}': {s.reason}" for s in self.skips]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    __str__ = format
