"""DS-FL with confidently-wrong uploaders (valid probability rows, each all on a wrong class) under ``--robust
median``, in process through the coordinator's round engine: 1 of 10 ends within 2 points of the all-honest run of
the same seed and rule, 3 of 10 within 5, and under the plain mean 3 of 10 ruin the run.

10 rounds, not 5: at round 5 every run is still on the steep part of its learning curve (+10 points a round on this
seed), where a half-round delay reads as 5 points; the per-round soft labels under 1 attacker stay within 2 points of
the honest run's accuracy on the open samples (measured, see docs/deployment.md).
"""

from __future__ import annotations

from insiders import dsfl_accuracies

ROUNDS = 10


def test_the_median_holds_one_and_three_confidently_wrong_uploaders_of_ten() -> None:
    honest = dsfl_accuracies("median", 0, ROUNDS)[-1]
    assert honest > 0.85, honest
    one = dsfl_accuracies("median", 1, ROUNDS)[-1]
    three = dsfl_accuracies("median", 3, ROUNDS)[-1]
    assert honest - one <= 0.02 and honest - three <= 0.05, (honest, one, three)


def test_the_mean_does_not_hold_three() -> None:
    """The attack is strong enough to matter: the papers' mean falls far (measured 72.9% -> 0.7% at 5 rounds, so 5
    rounds say it)."""
    assert dsfl_accuracies("mean", 3, 5)[-1] < 0.5


def test_the_deployment_default_holds_one_confident_liar_at_every_round() -> None:
    """What a deployment runs for DS-FL (issue 52): after 10 rounds within 2 points of the honest run, and from round
    3 on never as far behind it as the papers' mean falls (measured: 8 points at most, round 6, against the mean's
    28 at round 3: the median delays learning by about a round, the mean lets the liar hold it back)."""
    from fedge.aggregation.robust import DEPLOYMENT_SOFT_LABEL_RULE

    def worst_gap(rule: str) -> tuple[float, float]:
        honest, attacked = dsfl_accuracies(rule, 0, ROUNDS), dsfl_accuracies(rule, 1, ROUNDS)
        return max(h - a for h, a in zip(honest[2:], attacked[2:], strict=True)), honest[-1] - attacked[-1]

    default_worst, default_final = worst_gap(DEPLOYMENT_SOFT_LABEL_RULE)
    mean_worst, _ = worst_gap("mean")
    assert default_final <= 0.02 and default_worst < mean_worst, (default_worst, default_final, mean_worst)
