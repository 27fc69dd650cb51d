"""Pipeline schedules as data, in one process: bubbles and activations against the papers' closed forms,
text/CSV round trips, structural validation, deadlocks, lowering to send/recv, Chrome traces and pictures.

Costs: EQUAL is F = B = 1; FB2 is F = 1, B = 2 (so I = W = 1 when the backward is split).
"""

import json

import pytest

from plait import PlaitError
from plait.layout import SCHEDULES
from plait.parallel.pipeline import (
    GENERATORS,
    KINDS,
    Action,
    Costs,
    Schedule,
    ScheduleError,
    build_schedule,
    draw_schedule,
    gpipe,
    interleaved,
    lower,
    naive,
    one_f_one_b,
    simulate,
    zero_bubble,
)

EQUAL = {"F": 1, "B": 1}
FB2 = {"F": 1, "B": 2}
CASES = [
    ("naive", 3, 2, 1),
    ("gpipe", 4, 6, 1),
    ("gpipe", 2, 3, 2),
    ("1f1b", 4, 8, 1),
    ("1f1b", 4, 2, 1),
    ("interleaved", 4, 8, 2),
    ("interleaved", 2, 4, 3),
    ("zero-bubble", 4, 8, 1),
    ("zero-bubble", 3, 2, 1),
    ("pipedream", 3, 5, 1),
]


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


# ---------------------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7), (8, 16), (4, 2)])
@pytest.mark.parametrize("costs", [EQUAL, FB2])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m, costs):
    result = simulate(build_schedule(name, p, m), costs)
    tf, tb = costs["F"], costs["B"]
    assert result.makespan == approx((m + p - 1) * (tf + tb))
    assert result.idle == approx([(p - 1) * (tf + tb)] * p)  # bubble time (p-1)(tF+tB) on every rank
    assert result.bubble_fraction == approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m", [(4, 1), (2, 3), (3, 2)])
def test_naive_runs_one_stage_at_a_time(p, m):
    result = simulate(naive(p, m), FB2)
    assert result.makespan == approx(m * p * 3)
    assert result.bubble_fraction == approx((p - 1) / p)
    assert result.peak_activations == [1] * p


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 4, 2), (4, 12, 3), (8, 16, 2)])
@pytest.mark.parametrize("tf, tb", [(1.0, 1.0), (1.0, 2.0)])
def test_interleaved_divides_the_bubble_by_v(p, m, v, tf, tb):
    """Narayanan et al. 2021: bubble time (p-1)/v x (tF+tB), with tF, tB the whole rank's share (a chunk: /v)."""
    result = simulate(interleaved(p, m, v), {"F": tf / v, "B": tb / v})
    flat = simulate(one_f_one_b(p, m), {"F": tf, "B": tb})
    assert result.idle == approx([(p - 1) * (tf + tb) / v] * p)
    assert flat.idle[0] / result.idle[0] == approx(v)
    assert result.bubble_fraction == approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12), (3, 7), (8, 16)])
def test_zero_bubble_h1_has_a_third_of_the_1f1b_bubble(p, m):
    """Qi et al. 2023, ZB-H1 with tF = tI = tW: bubble (p-1)(tF + tI - tW) = (p-1), 1F1B's is 3(p-1)."""
    costs = {"F": 1, "B": 2, "I": 1, "W": 1}
    zb, base = simulate(zero_bubble(p, m), costs), simulate(one_f_one_b(p, m), costs)
    assert zb.idle == approx([p - 1] * p)
    assert base.idle == approx([3 * (p - 1)] * p)
    assert zb.makespan == approx(3 * m + p - 1)
    assert zb.peak_activations == base.peak_activations == [p - r for r in range(p)]  # memory as 1F1B
    assert zb.peak_unfinished == [p] * p and max(base.peak_unfinished) == p  # counting until W: still p


@pytest.mark.parametrize("tf, ti, tw", [(2, 1, 1), (1, 1, 0.5), (1, 2, 1), (1, 3, 1), (1, 1, 1.5), (0.5, 1, 2)])
def test_zero_bubble_h1_general_costs(tf, ti, tw):
    """The paper's (p-1)(tF + tI - tW) while tW <= min(tF, tI); a longer W cannot hide more than the warm-up
    forwards (tF) or the first input-gradient wave (tI): (p-1) max(tF, tI, tF + tI - tW) in general."""
    p, m = 4, 8
    result = simulate(zero_bubble(p, m), {"F": tf, "B": ti + tw, "I": ti, "W": tw})
    assert result.idle == approx([(p - 1) * max(tf, ti, tf + ti - tw)] * p)


def test_in_flight_activations_gpipe_m_vs_1f1b_at_most_p():
    p, m = 4, 8
    assert simulate(gpipe(p, m)).peak_activations == [m] * p
    assert simulate(one_f_one_b(p, m)).peak_activations == [p - r for r in range(p)]
    assert simulate(one_f_one_b(p, 2)).peak_activations == [2, 2, 2, 1]
    # interleaved holds chunk activations (1/v of a rank each): rank 0 warms up 2(p-1) + (v-1)p + 1
    assert simulate(interleaved(p, m, 2)).peak_activations[0] == 2 * (p - 1) + p + 1


def test_overhead_delays_each_compute_action_unless_it_waits_anyway():
    # GPipe p=2 m=2, F=1 B=2, overhead 0.25 (worked by hand): rank 0 runs F0 0.25-1.25, F1 1.5-2.5; rank 1 F0
    # 1.25-2.25 (waited for its input: overhead hidden), F1 2.5-3.5, B0 3.75-5.75, B1 6-8; rank 0 B0 5.75-7.75
    # (waited), B1 8-10. Busy time is unchanged: the overhead is idle time.
    result = simulate(gpipe(2, 2), {"F": 1, "B": 2, "overhead": 0.25})
    starts = [[span.start for span in spans] for spans in result.timelines]
    assert starts == [[0.25, 1.5, 5.75, 8.0], [1.25, 2.5, 3.75, 6.0]] and result.makespan == 10.0
    assert result.busy == [6.0, 6.0] and result.bubble_fraction == pytest.approx(8 / 20)
    assert simulate(lower(gpipe(2, 2)), {"F": 1, "B": 2, "overhead": 0.25}).makespan == 10.0
    with pytest.raises(ScheduleError, match="overhead=-1 must be >= 0"):
        simulate(gpipe(2, 2), {"overhead": -1})


def test_p2p_latency_adds_one_hop_per_stage_boundary_each_way():
    p, m, c = 4, 6, 0.25
    result = simulate(gpipe(p, m), {"F": 1, "B": 2, "p2p": c})
    assert result.makespan == approx((m + p - 1) * 3 + 2 * (p - 1) * c)


def test_per_stage_costs():
    result = simulate(gpipe(2, 4), Costs(F=[1, 2], B=[2, 4]))
    assert result.busy == approx([4 * 3, 4 * 6])
    assert result.makespan == approx(1 + 4 * 2 + 4 * 4 + 2)  # the slow stage 1 sets the pace
    with pytest.raises(ScheduleError, match="per-stage"):
        simulate(gpipe(3, 2), Costs(F=[1, 2]))
    with pytest.raises(ScheduleError, match="unknown cost"):
        simulate(gpipe(2, 2), {"F": 1, "Bwd": 2})


# ---------------------------------------------------------------------------------------- text and CSV
@pytest.mark.parametrize("text", ["1F0", "0B3", "2W1", "3I12", "1SF0", "2RF0", "1SB0", "0RB0", "12F34"])
def test_action_text_round_trip(text):
    action = Action.parse(text)
    assert str(action) == text and action.kind in KINDS and repr(action) == f"Action({text})"
    assert Action.parse(" 0B3 ") == Action(0, "B", 3)


@pytest.mark.parametrize("text", ["F0", "1X0", "1F", "-1F0", "1f0", "1F0x", ""])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(ScheduleError, match="cannot parse") as info:
        Action.parse(text)
    assert isinstance(info.value, PlaitError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_text_and_csv_round_trip(name, p, m, v, tmp_path):
    schedule = build_schedule(name, p, m, v)
    assert Schedule.from_text(schedule.to_text()) == schedule
    back = Schedule.from_csv(schedule.to_csv(tmp_path / "s.csv"))
    assert back == schedule and back.name == schedule.name
    lowered = lower(schedule)
    assert Schedule.from_text(str(lowered)) == lowered


def test_hand_written_text_and_csv(tmp_path):
    text = """
        # my schedule: two ranks, two micro-batches
        0F0 0F1 0B0 0B1
        1: 1F0 1B0 1F1 1B1
    """
    schedule = Schedule.from_text(text)
    assert (schedule.p, schedule.m, schedule.v) == (2, 2, 1)
    assert schedule.actions[1] == [Action.parse(t) for t in "1F0 1B0 1F1 1B1".split()]
    (tmp_path / "custom.csv").write_text("rank,actions\n1,1F0,1B0,1F1,1B1\n0,0F0,0F1,0B0,0B1\n")
    from_csv = Schedule.from_csv(tmp_path / "custom.csv")
    assert from_csv == schedule and from_csv.name == "custom"
    assert simulate(schedule.validate(), EQUAL).makespan == approx(6)


def test_registry_covers_every_layout_schedule():
    assert set(GENERATORS) == set(SCHEDULES)
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 2, 2)


# ---------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "text, words",
    [
        ("0F0 0F1 0B0\n1F0 1F1 1B0 1B1", "0B1 is missing"),
        ("0F0 0F0 0B0\n1F0 1B0", "0F0 appears twice"),
        ("0F0 1F0 0B0\n1B0", "rank 0 runs 1F0, but stage 1 lives on rank 1"),
        ("0F0 0B0 0I0 0W0\n1F0 1B0", "both 0B0 and I/W"),
        ("0F0 0I0\n1F0 1B0", "0W0 is missing"),
        ("0F0 0B0\n1F0 1B0 1SF0", "1SF0 has no peer"),
        ("0F0 0B0\n1F0 1RF0 1B0", "lowered schedule: 1RF0 on rank 1 has no matching 0SF0"),
    ],
)
def test_validate_names_the_offending_action(text, words):
    with pytest.raises(ScheduleError, match=words):
        Schedule.from_text(text).validate()


def test_validate_checks_ranges():
    with pytest.raises(ScheduleError, match="micro-batch 1, but m=1"):
        Schedule.from_text("0F0 0B0 0F1 0B1\n1F0 1B0 1F1 1B1", m=1).validate()
    with pytest.raises(ScheduleError, match="names stage 2"):
        Schedule.from_text("0F0 0B0 2F0\n1F0 1B0", v=1).validate()
    with pytest.raises(ScheduleError, match="rank lists but p=3"):
        Schedule(3, 1, [[], []]).validate()


def test_generators_reject_bad_sizes():
    with pytest.raises(ScheduleError, match="multiple of pp: m=6, p=4"):
        interleaved(4, 6, 2)
    with pytest.raises(ScheduleError, match="multiple of pp"):
        build_schedule("interleaved", 3, 4, 2)
    with pytest.raises(ScheduleError, match="interleaved"):
        one_f_one_b(2, 4, 2)
    with pytest.raises(ScheduleError, match="v=1"):
        zero_bubble(2, 4, 2)
    with pytest.raises(ScheduleError, match="m=0"):
        gpipe(2, 0)
    assert interleaved(2, 3, 1).name == "interleaved"  # v = 1 is plain 1F1B


# ---------------------------------------------------------------------------------------- order and deadlocks
def test_custom_schedule_that_deadlocks_is_rejected_naming_the_actions():
    # rank 0 waits for the backward of micro-batch 0; rank 1 first wants the forward of micro-batch 1
    schedule = Schedule.from_text("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0")
    schedule.validate()  # structurally fine
    with pytest.raises(ScheduleError) as info:
        simulate(schedule)
    message = str(info.value)
    assert "deadlock" in message
    assert "rank 0 is at 0B0, waiting for 1B0 on rank 1" in message
    assert "rank 1 is at 1F1, waiting for 0F1 on rank 0" in message
    with pytest.raises(ScheduleError, match="deadlock"):
        lower(schedule)


@pytest.mark.parametrize(
    "text, words",
    [
        ("0B0 0F0\n1F0 1B0", "rank 0: 0B0 .position 0. is listed before 0F0"),
        ("0F0 0W0 0I0\n1F0 1B0", "0W0 .position 1. is listed before 0I0"),
        ("0F0 0B0 0F1 0B1 2B0 2F0 2F1 2B1\n1F0 1B0 1F1 1B1 3F0 3B0 3F1 3B1", "2B0 .position 4. is listed before 2F0"),
    ],
)
def test_backward_before_its_forward_on_the_same_rank_is_rejected(text, words):
    with pytest.raises(ScheduleError, match=words):
        simulate(Schedule.from_text(text))


def test_lowered_recv_order_must_match_send_order():
    text = "0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1\n1RF1 1F1 1RF0 1F0 1B0 1SB0 1B1 1SB1"
    with pytest.raises(ScheduleError, match="rank 1 receives 1RF1 as message #0 from rank 0"):
        simulate(Schedule.from_text(text))


def test_lowered_send_recv_order_that_deadlocks_when_sends_block():
    # fine with buffered sends, but rank 0 sends micro-batch 1 before receiving 0's gradient while rank 1 sends
    # that gradient before receiving micro-batch 1: with blocking sends (NCCL streams) both wait forever
    text = (
        "0F0 0SF0 0F1 0SF1 0F2 0SF2 0RB0 0B0 0RB1 0B1 0RB2 0B2\n"
        "1RF0 1F0 1I0 1SB0 1W0 1RF1 1F1 1I1 1SB1 1W1 1RF2 1F2 1I2 1SB2 1W2"
    )
    with pytest.raises(ScheduleError) as info:
        simulate(Schedule.from_text(text))
    assert "rank 0 is at 0SF1, waiting for rank 1 to post 1RF1" in str(info.value)
    assert "rank 1 is at 1SB0, waiting for rank 0 to post 0RB0" in str(info.value)
    unlowered = Schedule.from_text(
        "\n".join(" ".join(t for t in line.split() if not Action.parse(t).is_comm) for line in text.splitlines())
    )
    simulate(unlowered)
    simulate(lower(unlowered))  # lower() orders the same compute actions without a deadlock


# ---------------------------------------------------------------------------------------- lowering
@pytest.mark.parametrize("name, p, m, v", CASES)
@pytest.mark.parametrize("costs", [FB2, {"F": 1, "B": 2, "p2p": 0.5}, {"F": [1, 3, 1, 2, 1, 1, 1, 1], "B": 2}])
def test_lower_inserts_sends_and_recvs_without_changing_the_timeline(name, p, m, v, costs):
    schedule = build_schedule(name, p, m, v)
    lowered = lower(schedule, costs).validate()
    assert lowered.is_lowered == (p > 1) and not schedule.is_lowered
    for rank, acts in enumerate(lowered.actions):
        assert [a for a in acts if not a.is_comm] == schedule.actions[rank]
        for i, a in enumerate(acts):
            if a.kind in ("SF", "SB"):  # after its producer, with only other sends/recvs in between
                producer = max(k for k in range(i) if not acts[k].is_comm)
                assert schedule.comms(acts[producer])[-1] == a
            if a.kind in ("RF", "RB"):  # before its consumer
                assert any(c == a for b in acts[i + 1 :] for c in schedule.comms(b))
    assert simulate(lowered, costs).makespan == approx(simulate(schedule, costs).makespan)
    if lowered.is_lowered:
        with pytest.raises(ScheduleError, match="already lowered"):
            lower(lowered)


def test_lowered_text_for_1f1b():
    lowered = lower(one_f_one_b(2, 2))
    assert lowered.to_text().splitlines()[1:] == [
        "0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1",
        "1RF0 1F0 1RF1 1B0 1SB0 1F1 1B1 1SB1",
    ]


# ---------------------------------------------------------------------------------------- trace and picture
def test_chrome_trace_is_well_formed():
    result = simulate(lower(zero_bubble(3, 4)), FB2)
    trace = json.loads(json.dumps(result.to_chrome_trace()))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == sum(len(acts) for acts in result.schedule.actions)
    assert {e["tid"] for e in events} == {0, 1, 2} and {e["pid"] for e in events} == {0}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["name"] == str(Action.parse(e["name"])) for e in events)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["rank 0", "rank 1", "rank 2"]
    assert {e["cat"] for e in events} == {"forward", "backward-input", "backward-weight", "comm"}
    assert max(e["ts"] + e["dur"] for e in events) == approx(result.makespan * 1000)


def test_draw_writes_a_png(tmp_path):
    result = simulate(interleaved(2, 4, 2), FB2)
    path = draw_schedule(result, tmp_path / "pipeline.png", title="interleaved")
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bubble" in result.summary()
