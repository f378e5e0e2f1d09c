"""How many drafts to verify each step: the verify-length policy.

The choice maximises expected tokens per second of one step:

    rate(l) = E(l) / (t_draft[l > 0] + t_verify(l + 1)),   E(l) = 1 + sum_{j<=l} prod_{i<=j} p_i

where t_verify(L) is the measured cost of a target forward over L tokens (the per-model
profile, `profile.py`), t_draft the drafter's measured cost, and p_i the conditional
probability that draft i is accepted given drafts 1..i-1 were. p_i comes from a running
per-position estimate (this request's verified drafts, with forgetting) and, where the
drafts carry confidences (DSpark's confidence head; EAGLE-3's probability of each token it
drafts), from those calibrated against what was accepted. A chain drafter that reports them as
it drafts (EAGLE-3) is stopped before the planned length where they say the rest will not pay
(`VerifyPolicy.keep_drafting`).

l = 0 is a plain autoregressive step with no draft forward at all; it wins whenever
drafting cannot pay. While it wins, a probe draft runs now and then (with back-off) so the
policy notices when acceptance rises again.

Lossless: every decision depends only on the history and on drafts, never on the target's
answer to the block being verified. Under sampling, the length is chosen by a stopping rule
(draft i is admitted using confidences of rows <= i only, which depend on drafts before i);
under greedy decoding any function of the drafts is exact, so all confidences are used.

Every way of choosing the length is one `LengthPolicy` (plan before drafting, truncate after,
observe after verifying), and the loop (`mlxspec.engine.loop.generate_steps`) takes exactly one:
`FixedLength` (the full block, or at most n drafts), `ConfidenceCut` (--p-min) and
`ConfidenceSchedule` (--schedule) around another policy, and `VerifyPolicy` (adaptive, above).
A step's drafts come from a `Source`: none (an autoregressive step), the model drafter, or
prompt lookup, which carries the length of the n-gram that matched.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from mlxspec.engine.source import Kind, Source  # noqa: F401  (the policy's names for them)


def expected_tokens(p: Sequence[float], l: int) -> float:
    """E(l): tokens committed by a step verifying l drafts (the bonus included)."""
    e, surv = 1.0, 1.0
    for i in range(l):
        surv *= float(p[i])
        e += surv
    return e


def best_length(p: Sequence[float], verify_time: Sequence[float], draft_time: float, max_len: int,
                per_draft: float = 0.0, paid: int = 0) -> tuple[int, float]:
    """argmax_l rate(l) over l = 0..max_len -> (l, rate). verify_time[L - 1] = cost of L tokens;
    drafting l tokens costs draft_time + per_draft * l (a chain drafter runs one forward per draft),
    of which the first `paid` drafts are already drafted (per_draft * max(l - paid, 0)).

    Ties go to the shorter length (cheaper, and less to roll back)."""
    max_len = min(max_len, len(p), len(verify_time) - 1)
    best_l, best = 0, 1.0 / verify_time[0]
    e, surv = 1.0, 1.0
    for l in range(1, max_len + 1):
        surv *= float(p[l - 1])
        e += surv
        r = e / (draft_time + per_draft * max(l - paid, 0) + verify_time[l])
        if r > best * (1 + 1e-9):
            best_l, best = l, r
    return best_l, best


def stopping_length(known: Sequence[float], prior: Sequence[float], verify_time: Sequence[float],
                    draft_time: float) -> int:
    """Sampling-safe length: admit draft i while the best plan that includes it, using the
    known (draft-dependent) p for rows <= i and history-only `prior` p beyond, beats the
    best plan that stops before it. Row i's decision never looks at rows > i."""
    n = len(known)
    for i in range(1, n + 1):
        p = list(known[:i]) + list(prior[i:n])
        l_all, _ = best_length(p, verify_time, draft_time, n)
        if l_all < i:
            return i - 1
    return n


@dataclass
class AcceptanceEstimate:
    """Per-position conditional acceptance with exponential forgetting (a Beta posterior
    mean per position). Position i (1-based) is *tried* when it was verified and drafts
    1..i-1 were accepted."""

    size: int
    decay: float = 0.9
    prior_mean: float = 0.3  # optimistic enough to try a new drafter, cheap to unlearn
    prior_weight: float = 2.0
    # prior of positions >= 2 (conditional on the previous draft accepted), or the previous
    # position's estimate where that is higher; None = the previous position's estimate. A lookup
    # copies a span: once its first token is right, the next ones usually are (measured on
    # held-out code: 0.75-0.95 conditional acceptance)
    continuation_prior: float | None = None
    # a prior per position (set by the policy for a lookup match length from what it learned of
    # shorter matches); None: prior_mean, then continuation_prior / the previous position's
    prior_vec: np.ndarray | None = None
    tried: np.ndarray = field(init=False)
    hit: np.ndarray = field(init=False)

    def __post_init__(self):
        self.tried = np.zeros(self.size)
        self.hit = np.zeros(self.size)

    def observe(self, verified: int, accepted: int) -> None:
        accepted = min(accepted, verified)  # never more accepted than verified (a hit without a try)
        self.tried *= self.decay
        self.hit *= self.decay
        m = min(verified, accepted + 1, self.size)
        self.tried[:m] += 1.0
        self.hit[: min(accepted, self.size)] += 1.0

    def p(self) -> np.ndarray:
        """Posterior means; position i's prior is position i-1's estimate (position 1's is
        prior_mean), so a drafter that is right early is trusted with longer drafts quickly.
        With continuation_prior (a lookup): position i's prior is the higher of it and position
        i-1's estimate: a lookup right 7 times in 7 at every position it was verified at is not
        assumed worse at position 8, which is never tried while the plan stops at 7, so its
        estimate would never learn otherwise. Where prior_vec is set, position i's prior is
        prior_vec[i] (position 1), or the higher of the two (later positions of a lookup)."""
        out = np.empty(self.size)
        for i in range(self.size):
            if i == 0:
                prior = self.prior_mean
            elif self.continuation_prior is None:
                prior = out[i - 1]
            else:
                prior = max(self.continuation_prior, out[i - 1])
            if self.prior_vec is not None:
                pv = float(self.prior_vec[i])
                prior = pv if i == 0 or self.continuation_prior is None else max(pv, prior)
            out[i] = (self.hit[i] + prior * self.prior_weight) / (self.tried[i] + self.prior_weight)
        return out

    def optimistic(self, z: float = 1.0) -> np.ndarray:
        """p() raised by z standard deviations of each position's posterior (its weight: the
        decayed verifications plus the prior's), capped at 1: what the source may still be
        worth while it has been verified too little to rule it out."""
        m = self.p()
        n = self.tried + self.prior_weight
        return np.minimum(1.0, m + z * np.sqrt(m * (1.0 - m) / n))


@dataclass
class Calibration:
    """Scale from a confidence head's outputs to observed acceptance (ratio estimate)."""

    weight: float = 4.0
    conf_sum: float = 0.0
    hit_sum: float = 0.0

    def observe(self, conf: Sequence[float], verified: int, accepted: int) -> None:
        m = min(verified, accepted + 1, len(conf))
        self.conf_sum = 0.95 * self.conf_sum + float(sum(conf[:m]))
        self.hit_sum = 0.95 * self.hit_sum + float(min(accepted, m))

    def apply(self, conf: Sequence[float]) -> list[float]:
        k = (self.hit_sum + self.weight) / (self.conf_sum + self.weight)
        return [min(1.0, max(0.0, float(c) * k)) for c in conf]


@dataclass
class Plan:
    source: Source
    n: int  # drafts to ask for (0 = autoregressive step)
    probe: bool = False


class LengthPolicy(Protocol):
    """How many drafts a step verifies, consulted by the loop at every step of one request.
    Decisions depend only on the history and the drafts (never on the target's answer to the
    block being verified), so every policy is lossless."""

    def plan(self, n_cap: int, lookup_len: int = 0, match: int = 0, model_drafts: bool = True) -> Plan:
        """Before drafting: the source and how many drafts to ask it for (at most n_cap).
        lookup_len / match: prompt lookup's proposal this step (0: none) and its n-gram
        length; model_drafts: whether the drafter's draft() is available."""

    def truncate(self, source: Source, n: int, confidence: Sequence[float] | None, greedy: bool) -> int:
        """After drafting: how many of the n drafts to verify."""

    def observe(self, source: Source, verified: int, accepted: int, confidence: Sequence[float] | None = None,
                draft_seconds: float | None = None, verify_seconds: float | None = None, *,
                drafted: int | None = None) -> None:
        """After verifying: what the step drafted, verified and accepted, and what it cost
        (verify_seconds: the verify forward over verified + 1 tokens; None: not measured;
        drafted: the chain drafter's forwards behind draft_seconds where they differ from the
        plan's length, as when a tree stops growing early)."""


class FixedLength:
    """The drafter's full proposal every step, or at most `max_drafts` (--num-draft-tokens)."""

    def __init__(self, max_drafts: int | None = None):
        self.max_drafts = max_drafts

    def plan(self, n_cap: int, lookup_len: int = 0, match: int = 0, model_drafts: bool = True) -> Plan:
        return Plan(Source.DRAFTER, n_cap if self.max_drafts is None else min(n_cap, self.max_drafts))

    def truncate(self, source, n, confidence, greedy) -> int:
        return n

    def observe(self, source, verified, accepted, confidence=None, draft_seconds=None, verify_seconds=None, *,
                drafted=None) -> None:
        pass


class _Around:
    """A policy that cuts drafts by their confidences before handing them to `inner`."""

    def __init__(self, inner: LengthPolicy):
        self.inner = inner

    def cut(self, confidence: Sequence[float]) -> int:
        raise NotImplementedError

    def plan(self, n_cap: int, lookup_len: int = 0, match: int = 0, model_drafts: bool = True) -> Plan:
        return self.inner.plan(n_cap, lookup_len, match, model_drafts)

    def truncate(self, source, n, confidence, greedy) -> int:
        if confidence is not None:
            n = min(n, self.cut(confidence[:n]))
            if n <= 0:
                return 0
        return self.inner.truncate(source, n, confidence, greedy)

    def observe(self, source, verified, accepted, confidence=None, draft_seconds=None, verify_seconds=None, *,
                drafted=None) -> None:
        self.inner.observe(source, verified, accepted, confidence, draft_seconds, verify_seconds, drafted=drafted)


class ConfidenceCut(_Around):
    """--p-min: cut the draft at the first position whose confidence is below p_min."""

    def __init__(self, p_min: float, inner: LengthPolicy):
        super().__init__(inner)
        self.p_min = p_min

    def cut(self, confidence):
        return truncate_p_min(confidence, self.p_min)


class ConfidenceSchedule(_Around):
    """--schedule: the verify length from the confidences and the profiled verify speed
    (`choose_verify_length`)."""

    def __init__(self, sps: dict[int, float], inner: LengthPolicy):
        super().__init__(inner)
        self.sps = sps

    def cut(self, confidence):
        return choose_verify_length(confidence, self.sps)


def compose(policy: LengthPolicy | None = None, *, p_min: float | None = None, schedule: dict[int, float] | None = None,
            max_drafts: int | None = None) -> LengthPolicy:
    """One policy from the knobs: `policy` (default: FixedLength(max_drafts)), inside the
    confidence schedule (`schedule`: verify steps/second per length) inside the p_min cut."""
    out = policy if policy is not None else FixedLength(max_drafts)
    if schedule:
        out = ConfidenceSchedule(schedule, out)
    if p_min is not None:
        out = ConfidenceCut(p_min, out)
    return out


def choose_verify_length(confidence: list[float], sps: dict[int, float]) -> int:
    """The confidence scheduler: how many drafts to verify.

    Survival a_j = prod_{i<=j} c_i estimates P(first j drafts all accepted); verifying l
    drafts yields (1 + sum_{j<=l} a_j) tokens per step at SPS(1 + l) steps/s. Admit drafts
    in order and stop at the first non-improvement (the prefix rule keeps it lossless:
    the choice depends only on drafts, never on the target's answer).
    """
    best_l, best = 0, sps.get(1, 1.0)
    surv, expected = 1.0, 1.0
    for l, c in enumerate(confidence, start=1):
        if l + 1 not in sps:
            break
        surv *= c
        expected += surv
        val = expected * sps[l + 1]
        if val <= best:
            break
        best_l, best = l, val
    return best_l


def truncate_p_min(confidence: list[float], p_min: float) -> int:
    """Cut the draft at the first position whose confidence is below p_min."""
    for i, c in enumerate(confidence):
        if c < p_min:
            return i
    return len(confidence)


class VerifyPolicy:
    """The adaptive `LengthPolicy` (module docstring; state per request)."""

    def __init__(self, verify_time: Sequence[float], max_drafts: int, probe_every: int = 4, max_probe_every: int = 64,
                 decay: float = 0.95, cost_decay: float = 0.97, cost_prior: float = 1.0, cost_probe_weight: float = 0.3,
                 chain: bool = False, model_cap: int | None = None, probe_z: float = 1.0, stops_early: bool = False):
        # model_cap: the model drafter's most drafts where a lookup beside it may propose more
        # (max_drafts); None: max_drafts
        self.model_cap = max_drafts if model_cap is None else min(int(model_cap), max_drafts)
        # chain: the drafter runs one forward per draft (EAGLE-3), so its cost is per drafted
        # token and the plan drafts only as many as pay; a block drafter's forward costs the
        # same whatever the length, so it drafts the whole block and truncates afterwards
        self.chain, self.last_drafted = chain, 0
        # stops_early: a chain drafter that reports each draft's confidence as it drafts
        # (EAGLE-3): `keep_drafting` stops its chain before the planned length where they say
        # the rest will not pay
        self.stops_early = chain and stops_early
        vt = np.maximum.accumulate(np.asarray(verify_time, dtype=np.float64))  # cost never falls with length
        self.base_verify_time = [float(x) for x in vt]
        self.verify_scale: float | None = None  # observed / profiled verify time (machine load now)
        # the cost of each verify length actually used, as it runs: a decayed mean per length
        # (machine load changes the ratio between lengths too, not only the scale)
        self.cost_decay, self.cost_prior, self.cost_probe_weight = cost_decay, cost_prior, cost_probe_weight
        self.obs_sum = np.zeros(len(vt))
        self.obs_w = np.zeros(len(vt))
        self.max_drafts = min(max_drafts, len(self.verify_time) - 1)
        self.decay = decay
        self.est: dict[Source, AcceptanceEstimate] = {}
        self.calib: dict[Source, Calibration] = {}
        self.draft_time: dict[Source, float] = {}
        # exploration, per source: steps since it was last verified, and the current interval
        self.probe_base, self.max_probe_every = probe_every, max_probe_every
        # after a probe, probes stay frequent while the source's estimate raised by probe_z
        # standard deviations would pay: a drafter near break-even (EAGLE-3 at T=1: ~0.3
        # accepted) that dipped below it is not shut out for the rest of the request on a few
        # unlucky probes; a drafter that is never right is ruled out after a few more of them
        self.probe_z = probe_z
        self.interval: dict[Source, int] = {}
        self.waited: dict[Source, int] = {}
        self.last_probe = False

    @property
    def verify_time(self) -> list[float]:
        """Cost of a verify over L tokens (index L - 1): at each length, the decayed mean of the
        verifies measured at that length, shrunk towards the profile rescaled by all of them
        (weight `cost_prior`); never falling with length. A pure function of the history."""
        base = np.asarray(self.base_verify_time)
        w = self.obs_w
        seen = np.nonzero(w > 1e-3)[0]
        if len(seen):  # the measured/profiled ratio, interpolated between the lengths measured
            ratio = np.interp(np.arange(len(base)), seen, self.obs_sum[seen] / w[seen] / base[seen])
        else:
            ratio = np.full(len(base), self.verify_scale or 1.0)
        est = (self.obs_sum + self.cost_prior * base * ratio) / (w + self.cost_prior)
        return [float(x) for x in np.maximum.accumulate(est)]

    def cost_probe(self, l: int) -> int:
        """A verify length to measure instead of l drafts, or l: when the length half as long
        has not been measured lately, verify that many (truncating drafts is always lossless),
        so the policy learns how the cost *ratio* between lengths moves, not only its scale."""
        half = max(0, l // 2)
        if l >= 2 and self.obs_w[l] > 0.5 and self.obs_w[half] < self.cost_probe_weight:
            return half
        return l

    def observe_verify(self, length: int, seconds: float) -> None:
        """A measured verify forward over `length` tokens: rescales the profile (the lengths
        not used lately follow it) and joins that length's own decayed mean (the lengths in
        use follow what they really cost now, e.g. under contention, where the ratio between
        lengths moves as well)."""
        if 1 <= length <= len(self.base_verify_time) and seconds > 0:
            r = seconds / self.base_verify_time[length - 1]
            self.verify_scale = r if self.verify_scale is None else 0.8 * self.verify_scale + 0.2 * r
            self.obs_sum *= self.cost_decay
            self.obs_w *= self.cost_decay
            self.obs_sum[length - 1] += seconds
            self.obs_w[length - 1] += 1.0

    @classmethod
    def from_profile(cls, sps: dict[int, float], max_drafts: int, **kw) -> "VerifyPolicy":
        """sps: target verify steps/second per length (1 .. max_drafts + 1)."""
        lengths = sorted(sps)
        vt = [1.0 / sps[L] for L in lengths if L <= max_drafts + 1]
        return cls(vt, max_drafts, **kw)

    def estimate(self, source: str | Source) -> AcceptanceEstimate:
        """The running estimate of a source. Lookups keep one per n-gram match length
        (a 4-gram match is far more reliable than a 2-gram one on code, not on chat), each
        shrunk, while it has little data, towards the pooled lookup estimate (match 0) or, where
        higher, towards the longest shorter match length seen: a longer match is trusted at least
        as far as a shorter one, so a suffix match growing 4 -> 8 -> 16 -> 32 tokens (a file sent
        back) does not start each length over from the pooled estimate."""
        source = Source.of(source)
        if source not in self.est:
            if source.is_lookup:
                self.est[source] = AcceptanceEstimate(self.max_drafts, decay=self.decay, prior_mean=0.5,
                                                      continuation_prior=0.8)
            else:
                self.est[source] = AcceptanceEstimate(self.max_drafts, decay=self.decay)
        e = self.est[source]
        if source.is_lookup and source.shared and not source.match:
            # proposals from earlier requests' text start as trusted as this request's own, and
            # part from them as they are verified: they pay where requests repeat each other
            # (an agent's turns, held-out code) and not where they share only phrases (chat)
            e.prior_vec = self.estimate(Source.LOOKUP).p()
        if source.is_lookup and source.match:
            prior = self.estimate(source.pooled).p()
            shorter = [s for s, x in self.est.items() if s.is_lookup and s.shared == source.shared
                       and 0 < s.match < source.match and x.tried[0] > 1e-3]
            if shorter:
                prior = np.maximum(prior, self.estimate(max(shorter, key=lambda s: s.match)).p())
            e.prior_vec = prior
        return e

    def probe_interval(self, source: Source) -> int:
        return self.interval.get(source, self.probe_base)

    def plan(self, n_cap: int, lookup_len: int = 0, match: int = 0, model_drafts: bool = True, *,
             has_drafter: bool | None = None, lookup_source: str | None = None) -> Plan:
        """Before drafting: autoregressive, the free lookup proposal, or the drafter.

        match: the length of the n-gram the lookup matched; each match length keeps its own
        estimate. A source that keeps losing is still verified now and then (a probe, spaced
        out further after each failed one) so that its estimate can recover.
        has_drafter / lookup_source: the older names of model_drafts / match (engine.batch)."""
        if has_drafter is not None:
            model_drafts = has_drafter
        if lookup_source is not None:
            match = Source.of(lookup_source).match
        n_cap = min(n_cap, self.max_drafts)
        if n_cap <= 0:
            return Plan(Source.NONE, 0)
        options = []  # (rate, plan) for every source available this step
        if lookup_len > 0:
            src = Source.lookup(match)
            l, r = best_length(self.estimate(src).p(), self.verify_time, 0.0, min(lookup_len, n_cap))
            options.append((r if l > 0 else 0.0, Plan(src, l), min(lookup_len, n_cap)))
        if model_drafts:
            dt = self.draft_time.get(Source.DRAFTER, 0.0)
            m_cap = min(n_cap, self.model_cap)
            if self.chain:  # draft_time is per drafted token: draft only the length that pays
                l, r = best_length(self.estimate(Source.DRAFTER).p(), self.verify_time, 0.0, m_cap, dt)
                # a probe drafts what it will verify: the length that pays, at least one (each
                # draft is a forward; 7 drafted for 1 verified cost a chain drafter 6 forwards a probe).
                # A drafter whose drafts carry confidences may be stopped sooner (`keep_drafting`)
                options.append((r if l > 0 else 0.0, Plan(Source.DRAFTER, l), max(l, 1)))
            else:
                l, r = best_length(self.estimate(Source.DRAFTER).p(), self.verify_time, dt, m_cap)
                options.append((r if l > 0 else 0.0, Plan(Source.DRAFTER, m_cap), m_cap))
        best, best_rate = Plan(Source.NONE, 0), 1.0 / self.verify_time[0]
        for r, plan, _ in options:
            if r > best_rate:
                best, best_rate = plan, r
        for _, plan, full in options:  # the others wait; the longest-waiting due one is probed
            if plan.source == best.source:
                self.waited[plan.source] = 0
                continue
            self.waited[plan.source] = self.waited.get(plan.source, 0) + 1
            if best.source.kind is Kind.NONE and self.waited[plan.source] >= self.probe_interval(plan.source):
                best = Plan(plan.source, full, probe=True)
                self.waited[plan.source] = 0
        self.last_probe = best.probe
        self.last_drafted = best.n if best.source.kind is Kind.DRAFTER else 0
        return best

    def keep_drafting(self, confidence: Sequence[float], cap: int) -> bool:
        """While a chain drafter drafts (`stops_early`): whether one more draft pays, from the
        calibrated confidences of the drafts made so far (known p) and the running per-position
        estimate beyond them. Drafting on wins when the best length past them, paying a forward
        per further draft, beats the best length among them (whose drafting is paid). It reads
        only the drafts made, so it is a stopping rule: lossless under sampling too."""
        k = len(confidence)
        cap = min(cap, self.model_cap, len(self.verify_time) - 1)
        if k >= cap:
            return False
        known = self.calib.setdefault(Source.DRAFTER, Calibration()).apply(confidence)
        p = list(known) + list(self.estimate(Source.DRAFTER).p()[k:])
        dt = self.draft_time.get(Source.DRAFTER, 0.0)
        return best_length(p, self.verify_time, 0.0, cap, dt, paid=k)[0] > k

    def truncate(self, source: str | Source, n: int, confidence: Sequence[float] | None, greedy: bool) -> int:
        """After drafting: how many of the n drafts to verify (a probe verifies at least one;
        a lookup probe all of them: its drafts cost nothing and longer ones teach more)."""
        source = Source.of(source)
        if n <= 0:
            return 0
        if self.last_probe and source.kind is not Kind.DRAFTER:
            return n
        prior = list(self.estimate(source).p()[:n])
        dt = 0.0  # the draft is already paid for
        if confidence is not None and len(confidence) >= n:
            known = self.calib.setdefault(source, Calibration()).apply(confidence[:n])
            l = best_length(known, self.verify_time, dt, n)[0] if greedy else stopping_length(
                known, prior, self.verify_time, dt)
        else:
            l = best_length(prior, self.verify_time, dt, n)[0]
        if self.last_probe:
            return max(l, 1)
        return self.cost_probe(l) if greedy else l

    def observe(self, source: str | Source, verified: int, accepted: int, confidence: Sequence[float] | None = None,
                draft_seconds: float | None = None, verify_seconds: float | None = None, *,
                drafted: int | None = None) -> None:
        """After verifying (`LengthPolicy.observe`): the verify cost when measured, then the
        source's acceptance (nothing for an autoregressive step)."""
        source = Source.of(source)
        if verify_seconds is not None:
            self.observe_verify(verified + 1, verify_seconds)
        if source.kind is Kind.NONE:
            return
        if verified > 0:
            self.estimate(source).observe(verified, accepted)
            if source.is_lookup and source.match:
                self.estimate(source.pooled).observe(verified, accepted)  # the pooled estimate
            if confidence is not None:
                self.calib.setdefault(source, Calibration()).observe(confidence, verified, accepted)
        drafter = source.kind is Kind.DRAFTER
        if draft_seconds is not None and drafter:
            if self.chain:
                draft_seconds = draft_seconds / max(self.last_drafted if drafted is None else drafted, 1)
            old = self.draft_time.get(Source.DRAFTER)
            self.draft_time[Source.DRAFTER] = draft_seconds if old is None else 0.8 * old + 0.2 * draft_seconds
        if self.last_probe:
            # back to frequent probes once the estimate, given the benefit of the doubt, says
            # this source may pay again
            dt = self.draft_time.get(Source.DRAFTER, 0.0) if drafter else 0.0
            pays = best_length(self.estimate(source).optimistic(self.probe_z), self.verify_time, 0.0 if self.chain else dt,
                               self.model_cap if drafter else self.max_drafts,
                               dt if self.chain else 0.0)[0] > 0
            cur = self.probe_interval(source)
            self.interval[source] = self.probe_base if pays else min(2 * cur, self.max_probe_every)

    def inherit(self, old: "VerifyPolicy", cap: float) -> None:
        """Start from what an earlier request's policy learned: its estimates and calibrations
        (counts scaled down to at most `cap` verifications, so this request still moves them),
        draft time, verify-time scale and probe spacing."""
        for src, e in old.est.items():
            e = copy.deepcopy(e)
            k = min(1.0, cap / max(float(e.tried.max()), 1e-9))
            e.tried *= k
            e.hit *= k
            self.est[src] = e
        for src, c in old.calib.items():
            k = min(1.0, cap / max(c.conf_sum, 1e-9))
            self.calib[src] = Calibration(c.weight, c.conf_sum * k, c.hit_sum * k)
        self.draft_time = dict(old.draft_time)
        self.verify_scale = old.verify_scale
        if len(old.obs_w) == len(self.obs_w):
            k = min(1.0, cap / max(float(old.obs_w.sum()), 1e-9))
            self.obs_sum, self.obs_w = old.obs_sum * k, old.obs_w * k
        self.interval = dict(old.interval)
        self.waited = dict(old.waited)


class PolicyMemory:
    """What one speculator's requests learned, carried from each request's policy into the
    next one's (per sampling regime: acceptance at T=0 and T=1 differ). A drafter that is
    never right on this workload is then not re-explored from its optimistic prior on every
    request. Requests of one speculator run one after another (the server's worker, the API,
    the benchmark); each new policy reads the previous one's state as it is when created."""

    def __init__(self, cap: float = 12.0):
        self.cap = cap
        self._last: dict[str, VerifyPolicy] = {}

    def policy(self, key: str, make) -> VerifyPolicy:
        """A fresh policy from make(), started from the last policy made under `key`."""
        new = make()
        old = self._last.get(key)
        if old is not None:
            new.inherit(old, self.cap)
        self._last[key] = new
        return new
