"""A pipeline schedule run on processors that all ranks share (CPU ranks: ``Hardware.compute_units``).

The schedule simulator (``plait.parallel.pipeline.simulate``) gives each rank its own device, so a rank's bubble
is lost time. When ``replicas x p`` ranks share ``units`` processors, a waiting rank frees its processor for the
others: the ranks that have work progress at rate ``min(1, units / (replicas x running))`` (processor sharing,
Kleinrock 1967), where ``running`` counts this pipeline's busy stages and ``replicas`` the pipelines (dp x cp x
tp groups) that run the same schedule in lockstep. Event-driven: the rate changes only when an action starts or
ends. With ``units`` >= ``replicas x p`` it is the simulator's makespan.
"""

from __future__ import annotations

from plait.parallel.pipeline.schedule import Action, Schedule
from plait.parallel.pipeline.simulate import Costs, _needs


def shared_makespan(schedule: Schedule, costs: Costs, units: float, replicas: int = 1) -> float:
    """The step's length when every rank's compute shares ``units`` processors with ``replicas - 1`` other copies
    of this pipeline (module docstring); p2p transfers take ``costs.p2p`` and no processor."""
    schedule.validate()
    acts = schedule.actions
    pos = {a: (r, i) for r, rank_acts in enumerate(acts) for i, a in enumerate(rank_acts)}
    deps = {a: _needs(schedule, a, pos, schedule.is_lowered) for a in pos}
    p = len(acts)
    ptr = [0] * p
    done: dict[Action, float] = {}
    running: dict[int, tuple[Action, float]] = {}  # rank -> (action, work left)
    clock = 0.0

    def start_time(rank: int) -> float | None:
        a = acts[rank][ptr[rank]]
        times = [clock]
        for d in deps[a]:
            if d not in done:
                return None
            times.append(done[d] + (costs.p2p if pos[d][0] != rank else 0.0))
        return max(times)

    while len(done) < len(pos):
        pending: list[float] = []
        for rank in range(p):
            while rank not in running and ptr[rank] < len(acts[rank]):
                begin = start_time(rank)
                if begin is None:
                    break
                if begin > clock:
                    pending.append(begin)
                    break
                action = acts[rank][ptr[rank]]
                if action.is_comm or costs.of(action) == 0:
                    done[action] = clock
                    ptr[rank] += 1
                    continue
                running[rank] = (action, costs.of(action))
        if not running:
            if not pending:
                raise RuntimeError(f"schedule {schedule.name!r} cannot progress (a deadlock the simulator refuses)")
            clock = min(pending)
            continue
        rate = min(1.0, units / (replicas * len(running)))
        step = min(left / rate for _, left in running.values())
        if pending:
            step = min(step, min(pending) - clock)
        clock += step
        for rank, (action, left) in list(running.items()):
            left -= step * rate
            if left <= 1e-12 * max(1.0, costs.of(action)):
                done[action] = clock
                ptr[rank] += 1
                del running[rank]
            else:
                running[rank] = (action, left)
    return clock


__all__ = ["shared_makespan"]
