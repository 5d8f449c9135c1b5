"""The comparison's statistics (spes/eval/stats.py) against hand computations."""
import math
import statistics

import pytest

from spes.eval.stats import clustered_se, paired_difference


def test_clustered_standard_errors():
    """Windows of one document move together: clustering by document widens the SE; one window per document
    gives back the ordinary SE of the mean (up to the G/(G-1) factor)."""
    values = [1.0, 1.1, 0.9, 3.0, 3.1, 2.9]
    naive = statistics.stdev(values) / math.sqrt(6)
    assert clustered_se(values) == pytest.approx(naive * math.sqrt(6 / 5) * math.sqrt(5 / 6), rel=1e-12)
    by_doc = clustered_se(values, [0, 0, 0, 1, 1, 1])
    mean = statistics.fmean(values)
    want = math.sqrt(2 * (sum(v - mean for v in values[:3]) ** 2 + sum(v - mean for v in values[3:]) ** 2)) / 6
    assert by_doc == pytest.approx(want) and by_doc > naive
    assert math.isnan(clustered_se(values, [0] * 6)) and clustered_se([1.0]) == 0.0
    with pytest.raises(ValueError, match="6 values but 2 cluster labels"):
        clustered_se(values, [0, 1])
    runs = [{"seed": 0, "heldout_windows": [2.0, 2.1, 1.9, 4.0], "heldout_documents": [0, 0, 0, 1]}]
    base = [{"seed": 0, "heldout_windows": [1.0, 1.0, 1.0, 1.0]}]
    diff, se = paired_difference(runs, base)
    assert diff == pytest.approx(1.5) and se == pytest.approx(clustered_se([1.0, 1.1, 0.9, 3.0], [0, 0, 0, 1]))


def test_every_document_weighing_the_same():
    """Three windows of document 0, one of document 1: per document, each document's mean window difference
    counts once (1 and 2: mean 1.5, SE over the two documents 0.5), where the window-weighted mean is 1.25;
    each seed's per-document mean is what the verdict's seed rule reads."""
    from spes.eval.stats import paired_difference_by_document

    docs = [0, 0, 0, 1]
    runs = [{"seed": 0, "heldout_windows": [2.0, 2.0, 2.0, 4.0], "heldout_documents": docs},
            {"seed": 1, "heldout_windows": [2.0, 2.0, 2.0, 2.0], "heldout_documents": docs}]
    base = [{"seed": s, "heldout_windows": [1.0] * 4, "heldout_documents": docs} for s in (0, 1)]
    diff, se, per_seed = paired_difference_by_document(runs, base)
    assert diff == pytest.approx(1.5) and se == pytest.approx(statistics.stdev([1.0, 2.0]) / math.sqrt(2))
    assert per_seed == pytest.approx([2.0, 1.0])
    assert paired_difference(runs, base)[0] == pytest.approx(1.25)
    old = [{k: v for k, v in r.items() if k != "heldout_documents"} for r in runs]  # written before documents were
    assert paired_difference_by_document(old, base) == (None, None, [])
