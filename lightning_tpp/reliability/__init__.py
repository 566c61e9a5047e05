"""Failing fast: a watchdog per rank that ends every process when one fails (``watch``), and the checks that
ranks agree before the first step (``preflight``)."""

from lightning_tpp.reliability.preflight import RankDisagreementError, check_agreement, model_structure
from lightning_tpp.reliability.nonfinite import NonFiniteLossError, finite_everywhere
from lightning_tpp.reliability.watch import FailureWatch

__all__ = ["FailureWatch", "NonFiniteLossError", "RankDisagreementError", "check_agreement", "finite_everywhere",
           "model_structure"]
