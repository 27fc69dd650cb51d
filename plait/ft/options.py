"""How a replica group's ranks learn that they run under per-step fault tolerance: environment variables that the
fault-tolerant launcher (``plait.ft.launch``, ``plait train --ft``) or a user's own torchrun command sets.

    PLAIT_FT_GROUP       this replica group's index g in 0..R+K-1
    PLAIT_FT_GROUPS      R, the replica groups of the job (HSDP's dp_replicate): the data slots a step trains
    PLAIT_FT_SPARES      K, spare replica groups (default 0): they hold the state and step with the others, and one
                         takes a lost group's data slot at the next step (``plait.ft.session``)
    PLAIT_FT_LIGHTHOUSE  the quorum service's address (torchft's Lighthouse, e.g. http://127.0.0.1:29510)
    PLAIT_FT_BIND        the interface this group's quorum server listens on (default 127.0.0.1: one machine)
    PLAIT_FT_MIN_GROUPS  the fewest groups that may commit a step (default 1: the last group carries on alone)
    PLAIT_FT_TIMEOUT_S   how long a cross-group operation or a quorum may take (default 60)
    PLAIT_FT_REPLAY      a committed log (``plait.ft.log``): replay it without faults
    PLAIT_FT_FAULT       a testing aid: "where=sync,step=3,group=1" (group 1 dies inside the cross-group exchange of
                         step 3) or "where=heal,group=0" (group 0 dies while sending a healing group its state);
                         on the first attempt only
    PLAIT_FT_REJOIN_DELAY_S  a testing aid: a restarted group waits this long before it asks for a quorum (a
                         replacement node that takes a while to come back)
    PLAIT_FT_STEP_DELAY_S  a testing aid: sleep this long after each committed step (a tiny CPU model's steps take
                         milliseconds; a restarted group must find the run still going to rejoin it)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from plait.errors import ConfigError

GROUP_ENV, GROUPS_ENV, LIGHTHOUSE_ENV = "PLAIT_FT_GROUP", "PLAIT_FT_GROUPS", "PLAIT_FT_LIGHTHOUSE"
SPARES_ENV = "PLAIT_FT_SPARES"
BIND_ENV, MIN_GROUPS_ENV, TIMEOUT_ENV = "PLAIT_FT_BIND", "PLAIT_FT_MIN_GROUPS", "PLAIT_FT_TIMEOUT_S"
REPLAY_ENV, FAULT_ENV, DELAY_ENV = "PLAIT_FT_REPLAY", "PLAIT_FT_FAULT", "PLAIT_FT_STEP_DELAY_S"
REJOIN_ENV = "PLAIT_FT_REJOIN_DELAY_S"
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class FTOptions:
    """This replica group's part in a fault-tolerant job (module docstring)."""

    group: int
    groups: int
    lighthouse: str
    bind: str = "127.0.0.1"
    min_groups: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    replay: str | None = None
    fault: dict[str, str] | None = None
    step_delay_s: float = 0.0
    spares: int = 0
    rejoin_delay_s: float = 0.0

    @property
    def members(self) -> int:
        """Every replica group of the job: R that train and K spares (R + K)."""
        return self.groups + self.spares

    @staticmethod
    def timeout_from_env(environ: Mapping[str, str] = os.environ) -> float:
        """PLAIT_FT_TIMEOUT_S (ConfigError unless a number > 0)."""
        return _timeout(environ)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FTOptions | None:
        """The options the environment sets, or None when it sets none (plain training)."""
        if GROUPS_ENV not in environ:
            return None
        groups = _integer(environ, GROUPS_ENV, 1)
        group = _integer(environ, GROUP_ENV, 0)
        spares = _integer(environ, SPARES_ENV, 0) if SPARES_ENV in environ else 0
        if group >= groups + spares:
            raise ConfigError(
                f"{GROUP_ENV}={group} must be below {GROUPS_ENV}={groups} + {SPARES_ENV}={spares}. Fix: number "
                f"groups 0..{groups + spares - 1}."
            )
        lighthouse = environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise ConfigError(
                f"{GROUPS_ENV} is set but {LIGHTHOUSE_ENV} is not: a replica group needs the quorum service's address. "
                f"Fix: start one with `plait lighthouse` and set {LIGHTHOUSE_ENV} to the address it prints."
            )
        min_groups = _integer(environ, MIN_GROUPS_ENV, 1) if MIN_GROUPS_ENV in environ else 1
        if min_groups > groups:
            raise ConfigError(f"{MIN_GROUPS_ENV}={min_groups} exceeds the {groups} replica groups. Fix: 1..{groups}.")
        timeout = cls.timeout_from_env(environ)
        fault = None
        if environ.get(FAULT_ENV):
            fault = dict(item.split("=", 1) for item in environ[FAULT_ENV].split(",") if "=" in item)
            if fault.get("where") not in ("sync", "heal") or not fault.get("group", "").isdigit():
                raise ConfigError(
                    f"{FAULT_ENV}={environ[FAULT_ENV]!r}: where= must be sync or heal, group= a group. Fix: "
                    f"where=sync,step=3,group=1."
                )
            if fault["group"] != str(group) or int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0):
                fault = None  # another group's, or this group was restarted: the fault has fired
        return cls(
            group=group,
            groups=groups,
            lighthouse=lighthouse,
            bind=environ.get(BIND_ENV, "127.0.0.1") or "127.0.0.1",
            min_groups=min_groups,
            timeout_s=timeout,
            replay=environ.get(REPLAY_ENV) or None,
            fault=fault,
            step_delay_s=float(environ.get(DELAY_ENV, "0") or 0),
            spares=spares,
            rejoin_delay_s=float(environ.get(REJOIN_ENV, "0") or 0),
        )


def _timeout(environ: Mapping[str, str]) -> float:
    try:
        timeout = float(environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={environ.get(TIMEOUT_ENV)!r} must be a number of seconds > 0. Fix: e.g. 60.")
    return timeout


def _integer(environ: Mapping[str, str], name: str, low: int) -> int:
    text = environ.get(name, "")
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise ConfigError(f"{name}={text!r} must be an integer >= {low}. Fix: set it as the launcher does.")
    return value


__all__ = ["FTOptions"]
