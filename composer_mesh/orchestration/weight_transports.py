"""How each generator's weights arrive, made visible: a GPU cluster whose ibverbs are broken moves weights over
Monarch's TCP fallback, which works but is slow, and without this nothing would say so.

Every generator answers each weight update with the transport it uses (`WeightVersion`: what moves the bytes,
why it was chosen, whether it is a fallback; decided in `mesh.weights.transports.choose`). From those answers
the run reports: one `weight_transports` event in metrics.jsonl at the start, one WARNING line then if any
generator is on a fallback (the controller's log shows WARNING; the procs' INFO lines do not reach the user),
the metric `weights/transport/<generator>` (a code, `TRANSPORT_CODES`) and `weights/transport_fallbacks` in
every step's record, and one row of the run's summary. `weights.require` turns a fallback into an error in the
generator itself, before any training step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from composer_mesh.actors.messages import WeightVersion
from composer_mesh.mesh.weights.config import USED_TRANSPORTS
from composer_mesh.orchestration.metrics import MetricsWriter

log = logging.getLogger("composer_mesh.weights")

# The metric's value per transport: slowest first, so a higher code is a faster path.
TRANSPORT_CODES: dict[str, int] = {name: code for code, name in enumerate(USED_TRANSPORTS)}

Links = Mapping[str, WeightVersion]  # generator name -> its latest answer that named a transport


def transport_metrics(links: Links) -> dict[str, float]:
    """The step's metrics: each generator's transport code and how many generators are on a fallback."""
    if not links:
        return {}
    out = {f"weights/transport/{g}": float(TRANSPORT_CODES[v.transport]) for g, v in links.items()}
    out["weights/transport_fallbacks"] = float(sum(v.fallback for v in links.values()))
    return out


def transport_lines(links: Links, fallbacks_only: bool = False) -> list[str]:
    """One line per distinct (transport, reason): "generator0, generator1: shm (auto: on the publisher's host)"."""
    groups: dict[tuple[str, str], list[str]] = {}
    for generator, v in links.items():
        if v.fallback or not fallbacks_only:
            groups.setdefault((v.transport, v.reason), []).append(generator)
    return [f"{', '.join(names)}: {transport} ({reason})" for (transport, reason), names in groups.items()]


def fallback_warning(links: Links) -> str | None:
    """The one line that says which generators are on a fallback transport and why; None when none is."""
    lines = transport_lines(links, fallbacks_only=True)
    if not lines:
        return None
    return (f"weights arrive over a fallback transport: {'; '.join(lines)}. Set weights.require "
            "(e.g. [cuda_ipc, shm, rdma]) to make this an error")


def announce(links: Links, writer: MetricsWriter) -> None:
    """At the run's start, once the generators hold the first weights: the event, and the warning if due."""
    writer.write_event("weight_transports", generators={
        g: {"transport": v.transport, "reason": v.reason, "fallback": v.fallback} for g, v in links.items()})
    warning = fallback_warning(links)
    if warning is not None:
        log.warning("%s", warning)
