"""Admission decisions: who goes now, who waits and in what order, who is shed and why."""

from __future__ import annotations

import pytest

from routing.admission import AdmissionPolicy, AdmissionQueue, Offer, Ticket
from routing.load import PodLoad

FREE = Offer(True)
FULL = Offer(False)


def always(offer: Offer):
    return lambda _ticket: offer


def ticket(name: str, priority: int = 1, tenant: str = "", **kw) -> Ticket:
    return Ticket(0.0, priority, tenant, item=name, **kw)


def drain(q: AdmissionQueue, offer: Offer = FREE) -> list[str]:
    """Dispatch every waiter the offer lets go, in the order the queue releases them."""
    order = []
    while (ready := q.next_ready(0.0, always(offer))) is not None:
        order.append(ready[0].item)
    return order


def test_a_request_goes_at_once_when_a_pod_has_room_and_nobody_waits():
    q = AdmissionQueue(AdmissionPolicy())
    offer = Offer(True, 0.2, decision="pod-a")
    verdict = q.arrive(ticket("r"), 0.0, always(offer))
    assert (verdict.kind, verdict.decision, verdict.predicted_ttft_s) == ("dispatch", "pod-a", 0.2)
    assert q.waiting == 0


def test_a_request_waits_while_every_pod_is_full_and_goes_when_one_frees():
    q = AdmissionQueue(AdmissionPolicy())
    assert q.arrive(ticket("r"), 0.0, always(FULL)).kind == "wait"
    assert q.lengths() == [0, 1, 0]
    assert q.next_ready(0.0, always(FULL)) is None
    assert drain(q) == ["r"]
    assert q.waiting == 0


def test_waiters_leave_in_priority_order_then_arrival_order():
    q = AdmissionQueue(AdmissionPolicy())
    for name, priority in [("low1", 2), ("normal1", 1), ("low2", 2), ("high1", 0), ("normal2", 1)]:
        q.arrive(ticket(name, priority), 0.0, always(FULL))
    assert drain(q) == ["high1", "normal1", "normal2", "low1", "low2"]


def test_a_newcomer_does_not_overtake_waiters_of_its_priority_even_when_a_pod_is_free():
    q = AdmissionQueue(AdmissionPolicy())
    q.arrive(ticket("first"), 0.0, always(FULL))
    assert q.arrive(ticket("second"), 0.0, always(FREE)).kind == "wait"
    assert q.arrive(ticket("urgent", 0), 0.0, always(FREE)).kind == "dispatch"  # only lower wait
    assert drain(q) == ["first", "second"]


def test_a_flooding_tenant_delays_only_itself():
    q = AdmissionQueue(AdmissionPolicy())
    for i in range(6):
        q.arrive(ticket(f"a{i}", tenant="a"), 0.0, always(FULL))
    q.arrive(ticket("b0", tenant="b"), 0.0, always(FULL))
    q.arrive(ticket("b1", tenant="b"), 0.0, always(FULL))
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_a_tenant_of_weight_two_gets_two_slots_for_each_of_a_weight_one_tenant():
    q = AdmissionQueue(AdmissionPolicy())
    for i in range(4):
        q.arrive(ticket(f"light{i}", tenant="light"), 0.0, always(FULL))
        q.arrive(ticket(f"heavy{i}", tenant="heavy", weight=2.0), 0.0, always(FULL))
    assert drain(q) == ["light0", "heavy0", "heavy1", "light1", "heavy2", "heavy3", "light2",
                        "light3"]  # fmt: skip


def test_a_tenant_returning_after_others_were_served_does_not_get_a_backlog_of_credit():
    q = AdmissionQueue(AdmissionPolicy())
    for i in range(3):
        q.arrive(ticket(f"a{i}", tenant="a"), 0.0, always(FULL))
    assert drain(q) == ["a0", "a1", "a2"]
    for i in range(3, 6):
        q.arrive(ticket(f"a{i}", tenant="a"), 0.0, always(FULL))
    for i in range(3):
        q.arrive(ticket(f"b{i}", tenant="b"), 0.0, always(FULL))
    # b starts at the queue's clock (where a2 left it), not at 0: it interleaves with a
    # instead of going first three times for the time it was away.
    assert drain(q) == ["b0", "a3", "b1", "a4", "b2", "a5"]


def dispatched_at(q: AdmissionQueue, *times: float) -> None:
    """Requests dispatched at once at ``times``: the rate the queue expects to drain at."""
    for at in times:
        assert q.arrive(ticket(f"at {at}", 0), at, always(FREE)).kind == "dispatch"


def test_a_full_queue_sheds_with_retry_after_from_the_drain_rate():
    q = AdmissionQueue(AdmissionPolicy(max_queue=2))
    dispatched_at(q, 0.0, 1.0, 2.0)  # one per second
    q.arrive(ticket("w1"), 2.0, always(FULL))
    q.arrive(ticket("w2"), 2.0, always(FULL))
    verdict = q.arrive(ticket("w3"), 2.0, always(FULL))
    assert (verdict.kind, verdict.reason, verdict.retry_after_s) == ("shed", "queue_full", 3)


def test_a_prediction_over_the_slo_is_shed_with_retry_after_of_the_overshoot():
    q = AdmissionQueue(AdmissionPolicy(ttft_slo_s=0.5))
    verdict = q.arrive(ticket("r"), 0.0, always(Offer(True, 2.2)))
    assert (verdict.kind, verdict.reason, verdict.retry_after_s) == ("shed", "slo", 2)
    assert verdict.predicted_ttft_s == 2.2
    assert q.waiting == 0


def test_the_request_slo_wins_over_the_default():
    q = AdmissionQueue(AdmissionPolicy(ttft_slo_s=0.5))
    assert q.arrive(ticket("lenient", slo_s=3.0), 0.0, always(Offer(True, 2.2))).kind == "dispatch"
    assert q.arrive(ticket("strict", slo_s=0.1), 0.0, always(Offer(True, 0.2))).kind == "shed"


def test_without_a_prediction_the_slo_is_judged_by_queue_position_and_drain_rate():
    q = AdmissionQueue(AdmissionPolicy(ttft_slo_s=1.0))
    assert q.arrive(ticket("unknown rate"), 0.0, always(FULL)).kind == "wait"  # no evidence yet
    dispatched_at(q, 0.0, 0.5, 1.0)  # two per second
    assert q.arrive(ticket("second in line"), 1.0, always(FULL)).kind == "wait"  # 2 / 2 = 1.0 s
    verdict = q.arrive(ticket("third in line"), 1.0, always(FULL))  # 3 / 2 = 1.5 s
    assert (verdict.kind, verdict.reason) == ("shed", "slo")
    assert verdict.predicted_ttft_s == pytest.approx(1.5)
    assert q.arrive(ticket("urgent", 0), 1.0, always(FULL)).kind == "wait"  # first of its level


def test_slo_action_queue_holds_a_request_until_its_prediction_fits_or_its_pod_is_idle():
    q = AdmissionQueue(AdmissionPolicy(ttft_slo_s=0.5, slo_action="queue"))
    assert q.arrive(ticket("r"), 0.0, always(Offer(True, 0.9))).kind == "wait"
    assert q.next_ready(0.0, always(Offer(True, 0.7))) is None
    assert drain(q, Offer(True, 0.4)) == ["r"]
    q.arrive(ticket("huge"), 0.0, always(Offer(True, 5.0)))
    assert drain(q, Offer(True, 5.0, pod_idle=True)) == ["huge"]  # waiting cannot help it


def test_a_timed_out_waiter_is_shed_and_a_dispatched_one_is_not():
    q = AdmissionQueue(AdmissionPolicy())
    waiting, gone = ticket("waiting"), ticket("gone")
    q.arrive(waiting, 0.0, always(FULL))
    q.arrive(gone, 0.0, always(FULL))
    q.next_ready(0.0, always(FREE))  # dispatches "waiting"
    assert q.time_out(waiting) is None
    verdict = q.time_out(gone)
    assert verdict is not None and (verdict.kind, verdict.reason) == ("shed", "queue_timeout")
    assert q.waiting == 0 and q.head() is None


def test_a_cancelled_waiter_leaves_the_queue_and_is_never_dispatched():
    q = AdmissionQueue(AdmissionPolicy())
    first, second = ticket("first"), ticket("second")
    q.arrive(first, 0.0, always(FULL))
    q.arrive(second, 0.0, always(FULL))
    assert q.cancel(first) is True and q.cancel(first) is False
    assert q.lengths() == [0, 1, 0]
    assert drain(q) == ["second"]


def test_cancelled_waiters_do_not_pile_up_in_the_queue():
    q = AdmissionQueue(AdmissionPolicy(max_queue=10_000))
    keep = ticket("keep")
    q.arrive(keep, 0.0, always(FULL))
    for i in range(1000):
        t = ticket(f"gone{i}")
        q.arrive(t, 0.0, always(FULL))
        q.cancel(t)
    assert q.waiting == 1
    assert sum(len(h) for h in q._heaps) < 200
    assert drain(q) == ["keep"]


def test_tenant_fairness_state_is_bounded():
    q = AdmissionQueue(AdmissionPolicy(max_tenants=8))
    for i in range(100):
        q.arrive(ticket(f"r{i}", tenant=f"t{i}"), 0.0, always(FULL))
    assert q.bounds()["tenant_tags"].size == 8 * 1  # one level used, capped at 8
    assert len(drain(q)) == 100


def test_a_priority_outside_the_levels_is_clamped_to_the_nearest():
    q = AdmissionQueue(AdmissionPolicy(priorities=2))
    q.arrive(ticket("too low", 7), 0.0, always(FULL))
    q.arrive(ticket("too high", -3), 0.0, always(FULL))
    assert q.lengths() == [1, 1]
    assert drain(q) == ["too high", "too low"]


def test_bad_policies_are_refused():
    with pytest.raises(ValueError):
        AdmissionPolicy(slo_action="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AdmissionPolicy(max_wait_s=0)
    with pytest.raises(ValueError):
        Ticket(0.0, weight=0)


def test_a_calm_tenant_is_judged_by_its_fair_place_not_by_a_flooding_tenants_backlog():
    q = AdmissionQueue(AdmissionPolicy(ttft_slo_s=3.0))
    dispatched_at(q, 0.0, 0.5, 1.0)  # two per second
    verdicts = [q.arrive(ticket(f"flood{i}", tenant="flood"), 1.0, always(FULL)).kind
                for i in range(8)]  # fmt: skip
    assert verdicts == ["wait"] * 6 + ["shed"] * 2  # the 7th in line would wait 3.5 s
    calm = q.arrive(ticket("calm", tenant="calm"), 1.0, always(FULL))
    assert (calm.kind, calm.predicted_ttft_s) == ("wait", 1.0)  # second in line, after flood0
    assert drain(q)[:3] == ["flood0", "calm", "flood1"]


def test_a_pod_has_room_under_both_limits_and_zero_means_no_limit():
    both = AdmissionPolicy(max_in_flight_per_pod=8, max_prefilling_per_pod=2)
    assert both.has_room(PodLoad(in_flight=7, prefilling=1))
    assert not both.has_room(PodLoad(in_flight=8, prefilling=0))
    assert not both.has_room(PodLoad(in_flight=3, prefilling=2))
    assert AdmissionPolicy().has_room(PodLoad(in_flight=10_000, prefilling=10_000))


def test_a_waiting_request_is_predicted_the_wait_for_a_slot_plus_the_pods_ttft_now():
    q = AdmissionQueue(AdmissionPolicy(ttft_slo_s=1.0))
    dispatched_at(q, 0.0, 0.25, 0.5)  # four per second
    full = always(Offer(False, predicted_ttft_s=0.6))  # every pod full; this one 0.6 s away
    predicted = [q.arrive(ticket(f"#{i}"), 0.5, full).predicted_ttft_s for i in range(3)]
    assert predicted == pytest.approx([0.85, 1.1, 1.1])  # the 2nd and 3rd would be late
    assert q.waiting == 1


def test_new_limits_apply_to_the_requests_already_waiting():
    q = AdmissionQueue(AdmissionPolicy(max_queue=10))
    for name in ("a", "b"):
        q.arrive(ticket(name), 0.0, always(FULL))

    q.set_policy(AdmissionPolicy(max_queue=2))

    assert q.waiting == 2 and q.policy.max_queue == 2
    assert q.arrive(ticket("c"), 0.0, always(FULL)).reason == "queue_full"
    assert drain(q) == ["a", "b"]


def test_fewer_priority_levels_requeue_the_waiters_in_their_order_at_their_new_levels():
    q = AdmissionQueue(AdmissionPolicy(priorities=3))
    for name, level in (("low-1", 2), ("high", 0), ("normal", 1), ("low-2", 2)):
        q.arrive(ticket(name, level), 0.0, always(FULL))

    # "normal" is gone: its waiters take "low"'s level, now 1
    q.set_policy(AdmissionPolicy(priorities=2), levels={0: 0, 1: 1, 2: 1})

    assert q.lengths() == [1, 3]
    assert drain(q) == ["high", "normal", "low-1", "low-2"]
