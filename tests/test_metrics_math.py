"""Evaluation arithmetic checked against the reference implementation."""

import pytest
import torch
from sklearn.metrics import f1_score

from app.tasks.classification import macro_f1


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("classes", [2, 5])
def test_macro_f1_matches_sklearn(seed, classes):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (200,), generator=generator)
    predicted = torch.where(
        torch.rand(200, generator=generator) < 0.6, labels, torch.randint(0, classes, (200,), generator=generator)
    )
    assert macro_f1(predicted, labels) == pytest.approx(f1_score(labels, predicted, average="macro"), abs=1e-6)


def test_macro_f1_counts_classes_that_are_only_predicted():
    labels, predicted = torch.tensor([0, 0, 0, 0]), torch.tensor([0, 0, 0, 1])
    assert macro_f1(predicted, labels) == pytest.approx(f1_score(labels, predicted, average="macro"))
