"""benchmarks/slo_model.py: the queue model that bounds what scheduling can do for the Poisson SLO."""

from __future__ import annotations

import pytest

from benchmarks import slo_model

COSTS = slo_model.Costs({4: 0.16, 8: 0.30, 16: 0.58})  # about the bench preset's solo latencies here


def test_costs_fit_a_step_and_a_fixed_part():
    assert abs(COSTS.per_step - 0.035) < 0.002 and abs(COSTS.fixed - 0.02) < 0.01


def test_edf_feasibility_is_exact_on_small_cases():
    assert slo_model.edf_feasible([(0.0, 1.0, 1.0), (0.0, 1.0, 2.0)])
    assert not slo_model.edf_feasible([(0.0, 1.0, 1.0), (0.0, 1.0, 1.5)])
    # a later, more urgent job preempts: feasible only with preemption at any instant
    assert slo_model.edf_feasible([(0.0, 2.0, 3.0), (0.5, 0.5, 1.0)])


def test_no_policy_beats_the_bound_and_hopeless_last_helps_when_overloaded():
    """A burst of requests at once: more than the server can finish within their SLOs."""
    burst = [(0.0, 16)] * 3 + [(0.01, 4)] * 6
    best = slo_model.most_on_time(burst, COSTS, 3.0, max_late=len(burst))
    shares = {p: slo_model.attainment(p, burst, COSTS, 3.0) for p in slo_model.POLICIES}
    assert all(share <= best / len(burst) + 1e-9 for share in shares.values()), (best, shares)
    assert shares["edf_hopeless_last"] > shares["edf"] and shares["srpt"] >= shares["arrival"]
    assert best < len(burst)  # the burst is more than any schedule can serve on time


def test_each_round_is_bounded_at_its_own_calibration():
    """Two rounds of the benchmark's sequence: the second calibrated on a machine twice as slow, at half the
    rate (the same load): the same bound; a third at the first round's solo latencies but twice its rate
    (an overload) is bounded lower."""
    from benchmarks.run import poisson_specs

    specs = poisson_specs(12, 128, (4, 8, 16), 0)
    solo = {"128x128/4": 0.2, "128x128/8": 0.35, "128x128/16": 0.65}
    rate = 0.8 * len(specs) / sum(solo[s.shape_key] for s in specs)
    rounds = [{"offered_rate": rate, "solo_latency_s": solo},
              {"offered_rate": rate / 2, "solo_latency_s": {k: 2 * v for k, v in solo.items()}},
              {"offered_rate": rate * 2, "solo_latency_s": solo}]
    model = slo_model.round_bounds(rounds, specs, 3.0)
    first, slower, overloaded = model["on_time"]
    assert model["requests"] == 12 and first == slower and (overloaded is None or overloaded < first)


def test_deadline_order_shares_steps_only_where_that_pays():
    """Where a step of two costs two solo steps, the engine's deadline order never shares and schedules as
    earliest-deadline-first with hopeless requests last; where sharing is cheap it finishes more on time."""
    burst = [(0.0, 16)] * 3 + [(0.01, 4)] * 6
    alone = slo_model.attainment("edf_hopeless_last", burst, COSTS, 3.0)
    assert slo_model.shared_attainment(burst, COSTS, 3.0, {1: 1.0, 2: 2.0}) == alone
    assert slo_model.shared_attainment(burst, COSTS, 3.0, {1: 1.0, 2: 1.2}) > alone


def test_the_step_ratio_comes_from_the_runs_phase_profile():
    ratio = slo_model.step_ratio({"offline": {"profile": {"step_s_by_rows": {"1": 0.2, "2": 0.3}}}})
    assert ratio == {1: 1.0, 2: pytest.approx(1.5)}
    assert slo_model.step_ratio({}) == {}
