"""The continuous-batching policy as plain state: admission, chunked prefill, preemption."""

from trioserve.scheduler._kv_blocks import KVBlockManager
from trioserve.scheduler._llm_policy import (
    ContinuousBatchingPolicy,
    SchedulerLimits,
    SeqStatus,
    Sequence,
)


def _policy(num_blocks=16, block_size=4, max_num_seqs=8, max_tokens=64, caching=True):
    blocks = KVBlockManager(num_blocks, block_size, prefix_caching=caching)
    return ContinuousBatchingPolicy(blocks, SchedulerLimits(max_num_seqs, max_tokens))


def _seq(arrival, prompt_len, priority=0, n=1, token=1):
    return Sequence(
        f"r{arrival}", 0, [token] * prompt_len, prompt_len, priority, arrival, pending_forks=n - 1
    )


def _run_step(policy):
    """Schedule, then do what the engine does after the step: count tokens, sample one."""
    plan = policy.schedule()
    for seq, count in plan.chunks:
        policy.computed(seq, count)
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(7)
    return plan


def test_fcfs_within_priority():
    policy = _policy(max_num_seqs=2)
    late, early, urgent = _seq(2, 4), _seq(1, 4), _seq(3, 4, priority=-1)
    for seq in (late, early, urgent):
        policy.add(seq)
    plan = policy.schedule()
    assert [s for s, _ in plan.chunks] == [urgent, early]
    assert policy.waiting == [late]


def test_admission_stops_at_max_num_seqs_and_at_free_blocks():
    policy = _policy(num_blocks=4, max_num_seqs=3)
    seqs = [_seq(i, 6) for i in range(4)]  # 2 blocks each
    for seq in seqs:
        policy.add(seq)
    plan = policy.schedule()
    assert [s for s, _ in plan.chunks] == seqs[:2]  # blocks ran out before max_num_seqs
    assert policy.blocks.num_free == 0


def test_an_n_sample_request_reserves_its_places():
    policy = _policy(max_num_seqs=3)
    policy.add(_seq(0, 4))
    policy.add(_seq(1, 4, n=3))
    plan = policy.schedule()
    assert len(plan.chunks) == 1  # 1 + 3 places would exceed 3


def test_chunked_prefill_keeps_decodes_going():
    policy = _policy(num_blocks=32, max_tokens=8)
    short = _seq(0, 3)
    policy.add(short)
    assert [(s, n) for s, n in _run_step(policy).chunks] == [(short, 3)]
    long = _seq(1, 20)
    policy.add(long)
    plans = [_run_step(policy).chunks for _ in range(3)]
    # Each step: the decode first, then as much of the long prompt as the budget allows.
    assert plans == [[(short, 1), (long, 7)], [(short, 1), (long, 7)], [(short, 1), (long, 6)]]
    assert long.num_computed == 20 and len(long.token_ids) == 21  # sampled after the last chunk


def test_preemption_takes_the_lowest_priority_latest_arrival_and_requeues_it_first():
    policy = _policy(num_blocks=3, block_size=4)
    a, b, c = _seq(0, 4), _seq(1, 4, priority=1), _seq(2, 4)
    for seq in (a, b, c):
        policy.add(seq)
    _run_step(policy)  # all three prefilled, one block each, each sampled a token
    assert policy.blocks.num_free == 0
    plan = policy.schedule()  # every decode needs a second block: none free
    # b has the lowest priority (highest value); its block lets a decode, then c
    # preempts itself (latest arrival among the same priority).
    assert plan.preempted == [b, c]
    assert [s for s, _ in plan.chunks] == [a]
    assert [s.status for s in (a, b, c)] == [
        SeqStatus.RUNNING,
        SeqStatus.WAITING,
        SeqStatus.WAITING,
    ]
    assert b.num_computed == 0 and b.blocks == [] and c.blocks == []
    assert policy.waiting == [c, b]  # by priority, then arrival
    later = _seq(5, 2)
    policy.add(later)
    assert policy.waiting == [c, later, b]  # c arrived before 'later'


def test_no_admission_in_a_step_that_preempted():
    policy = _policy(num_blocks=2, block_size=4)
    a, b = _seq(0, 4), _seq(1, 4)
    policy.add(a)
    policy.add(b)
    _run_step(policy)
    policy.add(_seq(2, 1))
    plan = policy.schedule()
    assert plan.preempted == [b] and plan.admitted == []


def test_recompute_after_preemption_reuses_cached_prompt_blocks():
    policy = _policy(num_blocks=4, block_size=4)
    seq = _seq(0, 9)
    policy.add(seq)
    _run_step(policy)
    assert seq.num_computed == 9 and len(seq.hashes) == 2
    policy._preempt(seq)
    plan = policy.schedule()
    assert plan.prefix_lookups == [(10, 8)]  # 10 tokens now; the two full blocks are cached
    assert plan.chunks == [(seq, 2)] and seq.num_computed == 8


def test_fork_shares_full_prompt_blocks_and_recomputes_the_partial_one():
    policy = _policy(num_blocks=8, block_size=4)
    parent = _seq(0, 6, n=2)
    policy.add(parent)
    _run_step(policy)
    child = policy.fork(parent, 1, 9)
    assert child.blocks == parent.blocks[:1] and policy.blocks.ref_count(parent.blocks[0]) == 2
    assert child.num_computed == 4 and child.token_ids == [1] * 6 + [9]
    assert policy.running == [parent, child] and parent.pending_forks == 0
    plan = policy.schedule()
    assert plan.chunks == [(parent, 1), (child, 3)]  # the prompt's tail and its own token
    policy.remove(parent)
    assert policy.blocks.ref_count(child.blocks[0]) == 1


def test_remove_frees_blocks_at_once_from_either_queue():
    policy = _policy(num_blocks=3)
    running, waiting = _seq(0, 8), _seq(1, 8)
    policy.add(running)
    policy.add(waiting)
    policy.schedule()
    assert policy.waiting == [waiting] and policy.blocks.num_used == 2
    policy.remove(waiting)
    policy.remove(running)
    assert policy.blocks.num_used == 0 and running.status is SeqStatus.FINISHED
    assert policy.waiting == [] and policy.running == [] and not policy.has_work
