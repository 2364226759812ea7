"""Evaluation arithmetic checked against the reference implementation."""

import pytest
import torch
from sklearn.metrics import f1_score

from app.tasks.classification import NO_PREDICTION, macro_f1


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


def test_macro_f1_counts_an_example_without_a_prediction_as_a_miss_of_its_label():
    # NO_PREDICTION (NaN or inf logits) is wrong for every label and is not a class of its own.
    labels, predicted = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, NO_PREDICTION, 1, NO_PREDICTION, 0])
    expected = f1_score(labels, predicted, labels=[0, 1], average="macro")
    assert macro_f1(predicted, labels) == pytest.approx(expected) and expected < macro_f1(
        torch.tensor([0, 0, 1, 1, 0]), labels
    )
