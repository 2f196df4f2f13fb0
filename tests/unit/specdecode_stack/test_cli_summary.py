"""The CLI's summary line says how much of a run speculated (issue 20): a mostly plain run
does not read as fully speculative."""

from specdecode.api.usage import Usage
from specdecode_stack.cli import speculation_summary


def test_the_summary_says_how_many_tokens_were_drafted():
    mostly_plain = Usage(completion_tokens=48, draft_tokens=4, accepted_tokens=4,
                         emitted_tokens=5, steps=47)
    assert speculation_summary(mostly_plain) == "acceptance 100% of 4 drafted in 47 steps"
    assert speculation_summary(Usage(completion_tokens=8, steps=8)) == "no draft token in 8 steps"
