"""The decision log (worker/scheduler/log.py): records in the format every version writes, typed
inside (Cell, Decision), and `replay`, which recomputes each decision from its inputs."""

from __future__ import annotations

import json

from worker.round import Cell
from worker.scheduler import LOG_BATCH, Candidate, Decision, Scheduler, decide, replay
from worker.scheduler.log import DecisionLog, cells_from_log, cells_to_log

# records written by the scheduler before it was a package (commit 7a08e4b, bench/simulator.py's
# rows): a probe, a plain exploration, a decision with one request, one with four (two with no
# room), a held round and a round's time with a catch-up paid apart
OLD_LOG = [
    '{"round": 171, "requests": ["0-0"], "n_requests": 1, "b_max": 16, "probe": true, "acceptance": [[0.6392874491012912]], "cost_table": {"1,0,0": 0.006688591392676797, "1,1,1": 0.019223796254634943, "1,3,3": 0.019583917206430136, "1,4,4": 0.020212000266357284, "1,8,8": 0.022861320224598258}, "cost_counts": {"1,0,0": 32, "1,1,1": 3, "1,3,3": 0, "1,4,4": 2, "1,8,8": 0}, "behind": [false], "switch_s": 0.0, "stop_s": 0.005218638924835334, "explore_plain": false, "explore_margin": 1.25, "draft_step_s": 0.0015106599267355654, "survival": [[0.6392874491012912]], "candidates": [{"B": 0, "D": 0, "cost": 0.006688591392676797, "gain": 1.0, "objective": 142.55662685926794}, {"B": 1, "D": 1, "cost": 0.019223796254634943, "gain": 1.6392874491012912, "objective": 85.27386721059591}], "budget": 1, "allocation": [1], "explored": false}',
    '{"round": 83, "requests": ["1-1"], "n_requests": 1, "b_max": 16, "probe": true, "acceptance": [[0.21086128440331997]], "cost_table": {"2,0,0": 0.055465407746511625, "3,0,0": 0.06694412659080573, "4,0,0": 0.08722338050837065, "4,3,1": 0.10343815497625647, "4,4,1": 0.10232699618081571}, "cost_counts": {"2,0,0": 2, "3,0,0": 1, "4,0,0": 3, "4,3,1": 0, "4,4,1": 32}, "behind": [true], "switch_s": 0.0, "stop_s": 0.0, "explore_plain": true, "explore_margin": 1.25, "draft_step_s": null, "survival": [[0.21086128440331997]], "candidates": [{"B": 0, "D": 0, "cost": 0.055465407746511625, "gain": 1.0, "objective": 18.029255361651835}, {"B": 1, "D": 1, "cost": 0.06506980735629714, "gain": 1.21086128440332, "objective": 18.6086502111972}], "budget": 0, "allocation": [0], "explored": true}',
    '{"round": 17, "requests": ["0-0"], "n_requests": 1, "b_max": 16, "probe": false, "acceptance": [[0.8826306639102316]], "cost_table": {"3,2,1": 0.09085795619879988, "4,0,0": 0.09538302545531087, "4,4,1": 0.10285307432353696, "4,8,2": 0.1317659380507741, "4,12,3": 0.15994365990611223, "4,16,4": 0.19414088963140785}, "cost_counts": {"3,2,1": 1, "4,0,0": 2, "4,4,1": 1, "4,8,2": 1, "4,12,3": 8, "4,16,4": 3}, "behind": [false], "switch_s": 0.0, "stop_s": 0.0, "explore_plain": true, "explore_margin": 1.25, "draft_step_s": null, "survival": [[0.8826306639102316]], "candidates": [{"B": 0, "D": 0, "cost": 0.09538302545531087, "gain": 1.0, "objective": 10.484045722249846}, {"B": 1, "D": 1, "cost": 0.10285307432353696, "gain": 1.8826306639102315, "objective": 18.304077698136528}], "budget": 1, "allocation": [1], "explored": false}',
    '{"round": 152, "requests": ["2-0", "2-1", "2-2", "2-3"], "n_requests": 4, "b_max": 16, "probe": false, "acceptance": [[], [], [0.5353366172458393, 0.548548642261996], [0.5430146485195037, 0.548548642261996]], "cost_table": {"1,1,1": 0.04829867209868379, "2,0,0": 0.058092042054753046, "2,2,1": 0.07010893333094464, "3,0,0": 0.07983351345813007, "3,2,1": 0.08532569236263694, "3,3,1": 0.09627213294962267, "4,0,0": 0.0913399752839288, "4,3,1": 0.11129787953077169, "4,4,1": 0.10934063382035798, "4,8,2": 0.13494652529322712, "4,12,3": 0.15268264485357072, "4,16,4": 0.18911401573609965}, "cost_counts": {"1,1,1": 1, "2,0,0": 3, "2,2,1": 1, "3,0,0": 3, "3,2,1": 1, "3,3,1": 2, "4,0,0": 4, "4,3,1": 3, "4,4,1": 32, "4,8,2": 23, "4,12,3": 0, "4,16,4": 0}, "behind": [false, false, false, false], "switch_s": 0.0, "stop_s": 0.0, "explore_plain": false, "explore_margin": 1.25, "draft_step_s": 0.016092256678378273, "survival": [[], [], [0.5353366172458393, 0.2936581745433349], [0.5430146485195037, 0.2978699481737487]], "candidates": [{"B": 0, "D": 0, "cost": 0.0913399752839288, "gain": 4.0, "objective": 43.792435760641126}, {"B": 1, "D": 1, "cost": 0.10934063382035798, "gain": 4.543014648519503, "objective": 41.5491888951685}, {"B": 2, "D": 1, "cost": 0.10934063382035798, "gain": 5.078351265765343, "objective": 46.445233472021556}, {"B": 3, "D": 2, "cost": 0.13494652529322712, "gain": 5.3762212139390915, "objective": 39.83964168219247}, {"B": 4, "D": 2, "cost": 0.13494652529322712, "gain": 5.669879388482427, "objective": 42.01574939526801}], "budget": 2, "allocation": [0, 0, 1, 1], "explored": false}',
    '{"round": 7, "requests": ["0-0"], "held": true, "allocation": [1]}',
    '{"round": 61, "observed": 0.02326452345988518, "shape": [1, 8, 8], "complete": true, "reason": "", "apart": {"draft prefill": [0.0389450172456227, 63, 6]}, "draft_s": 0.012298426498617693}',
]


def test_a_log_written_before_replays_without_a_difference():
    assert replay(OLD_LOG) == []
    decisions = [Decision.from_log(json.loads(line)) for line in OLD_LOG if '"n_requests"' in line]
    assert [(d.budget, d.explored) for d in decisions] == [(1, False), (0, True), (1, False), (2, False)]
    assert decisions[3].allocation == [0, 0, 1, 1] and decisions[3].candidates[2] == Candidate(
        2, 1, 0.10934063382035798, 5.078351265765343, 46.445233472021556)


def test_replay_reports_what_differs_and_where():
    rec = json.loads(OLD_LOG[2])
    rec["acceptance"] = [[0.01]]  # an input altered: drafting no longer pays
    diffs = replay([OLD_LOG[0], json.dumps(rec)])
    assert [d.split(":")[0] for d in diffs] == ["line 2 (round 17)"] * 4
    assert {d.split(": ")[1].split(" logged")[0] for d in diffs} == {"survival", "candidates", "budget", "allocation"}


def test_a_decision_is_logged_as_it_always_was():
    table = {Cell(1, 0, 0): 0.010, Cell(1, 1, 1): 0.012}
    d = decide([[0.9]], 1, table, 8)
    rec = d.to_log()
    assert list(rec) == ["survival", "candidates", "budget", "allocation", "explored"]
    assert rec["candidates"][1] == {"B": 1, "D": 1, "cost": 0.012, "gain": 1.9, "objective": 1.9 / 0.012}
    assert Decision.from_log(json.loads(json.dumps(rec))) == d
    assert Decision.from_log({k: v for k, v in rec.items() if k != "explored"}).explored is False  # an older record
    assert cells_to_log(table) == {"1,0,0": 0.010, "1,1,1": 0.012}
    assert cells_from_log(cells_to_log(table)) == table and cells_from_log(None) is None
    assert all(type(c) is Cell for c in cells_from_log({"4,16,4": 1.0}))


def test_a_scheduler_logs_every_decision_held_round_and_round_time_in_that_format(tmp_path):
    log = tmp_path / "log.jsonl"
    ticks = iter(range(1000))
    s = Scheduler(log_path=str(log), clock=lambda: float(next(ticks)))  # a decision takes 1 s: the next rounds hold
    s.cost.cells = {Cell(1, 0, 0): [(0, 0.030)] * 9, Cell(1, 1, 1): [(0, 0.036)] * 9}
    for _ in range(40):
        s.observe_cycle("a", 1, 1)
    for _ in range(3):
        k = s.plan(["a"], 1)[0]
        s.observe_cycle("a", k, k)
        s.observe_round(0.036 if k else 0.030, True, apart={"draft catch-up": (0.004, 6, 2)})
    s.flush_log()
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    decision, observed, held = recs[0], recs[1], recs[2]
    assert list(decision)[:14] == ["round", "requests", "n_requests", "b_max", "probe", "acceptance", "cost_table",
                                   "cost_counts", "behind", "switch_s", "stop_s", "explore_plain", "explore_margin",
                                   "draft_step_s"]
    k = decision["allocation"][0]
    assert decision["cost_table"] == {"1,0,0": 0.030, "1,1,1": 0.036} and k > 0
    assert observed == {"round": 1, "observed": 0.036, "shape": [1, k, k], "complete": True, "reason": "",
                        "apart": {"draft catch-up": [0.004, 6, 2]}, "draft_s": 0.0, "cycles": [["a", k, k]]}
    assert held == {"round": 2, "requests": ["a"], "held": True, "allocation": [k]} and len(recs) == 6
    assert replay(log.read_text().splitlines()) == []


def test_records_are_held_back_and_written_together(tmp_path):
    path = tmp_path / "log.jsonl"
    log = DecisionLog(str(path))
    for i in range(LOG_BATCH - 1):
        log.record({"round": i})
    assert path.read_text() == ""
    log.record({"round": LOG_BATCH - 1})
    assert len(path.read_text().splitlines()) == LOG_BATCH
    log.record({"round": LOG_BATCH})
    log.flush()
    assert json.loads(path.read_text().splitlines()[-1]) == {"round": LOG_BATCH}


def test_a_decision_logs_every_ns_draft_step_and_replays_with_them(tmp_path):
    """A decision prices other N's depths with their own draft steps (docs/scheduler.md, "A depth
    past the deepest measured costs at least the padding it adds"): its record carries them by N,
    and replays with them; one from before them replays with its own N's figure for every N."""
    log = tmp_path / "log.jsonl"
    s = Scheduler(log_path=str(log))
    cells = {Cell(4, 0, 0): 0.0835, Cell(4, 4, 1): 0.1333, Cell(4, 8, 2): 0.1673, Cell(8, 0, 0): 0.1087,
             Cell(8, 8, 1): 0.1788, Cell(8, 16, 2): 0.2330, Cell(16, 0, 0): 0.1427}
    s.cost.cells = {c: [(0, v)] * 9 for c, v in cells.items()}
    s.cost.draft_steps = {4: [0.0207] * 3, 8: [0.0248] * 3, 16: [0.036] * 3}
    ids = [f"r{i}" for i in range(16)]
    for _ in range(3):
        s.plan(ids, 16)
    s.flush_log()
    records = [json.loads(x) for x in log.read_text().splitlines() if '"candidates"' in x]
    assert records and all(r["draft_steps_s"] == {"4": 0.0207, "8": 0.0248, "16": 0.036} for r in records)
    assert all(r["draft_step_s"] == 0.036 for r in records)
    assert replay(log.read_text().splitlines()) == []
    old = [json.dumps({k: v for k, v in r.items() if k != "draft_steps_s"}) for r in records]
    assert replay(old)  # priced with 16 rows' step for every N, the same inputs decide otherwise
