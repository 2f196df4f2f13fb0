"""Structured output through the in-process engine: greedy output is the target's own
constrained decoding with speculation on and off (every proposer, both scorers, every kind),
sampled output follows the target's masked and renormalised distribution even when the draft
proposes tokens the grammar does not allow, and JSON outputs validate against their schema."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest
import torch

from orchestrator.engine.core import Request, SpecDecodeEngine
from scorer_svc.methods import make_scorer
from specdecode.grammar.matcher import Grammars
from specdecode.grammar.spec import StructuredOutput
from specdecode.interfaces import SpeculativeProposals, SpeculativeProposer
from specdecode.executor.model_runner import ModelRunner
from specdecode.sequence import SamplingParams
from specdecode.executor.worker import ModelWorker
from specdecode_stack.inprocess import build_inprocess_engine
from tests.structured import (DRAFT, EOS, TARGET, VOCAB, compiler, masked_pair_probs,
                              reference_greedy, tiny, tokenizer)
from tests.support.chi_square import chi_square_pvalue
from tests.support.models import CPU

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "level": {"enum": ["low", "mid", "high"]},
    "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
             "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "level", "ok"],
    "additionalProperties": False}
SPECS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredOutput("regex", r"(GET|POST) /[a-z]{1,8}(/[0-9]{1,3})?"),
    "choice": StructuredOutput("choice", choices=("positive", "negative", "neutral")),
    "grammar": StructuredOutput("grammar", 'start: "(" expr ")"\nexpr: /[0-9]/ | "(" expr ")"'
                                           ' "+" /[0-9]/'),
}
PROMPTS = [list(b"Reply: "), list(b"{\"q\": 1} -> "), list(b"xyz")]
MAX_TOKENS = 40
CASES = [(kind, "draft", "multi-query") for kind in sorted(SPECS)] + [
    ("json_schema", "draft", "batch-expansion"), ("json_schema", "ngram", "multi-query"),
    ("json_schema", "self", "batch-expansion")]


def constrained(so: StructuredOutput, max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=(EOS,), structured_output=so,
                          **kw)


@functools.cache
def expected_greedy(kind: str) -> list[list[int]]:
    return [reference_greedy(tiny(TARGET), p, SPECS[kind], MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("kind,proposer,scoring", CASES)
def test_greedy_equals_the_targets_constrained_decoding(kind, proposer, scoring):
    so, target = SPECS[kind], tiny(TARGET)
    draft = {"draft": tiny(DRAFT), "self": target, "ngram": "ngram"}[proposer]
    expected = expected_greedy(kind)
    for k in (0, 3):
        engine = build_inprocess_engine(target, draft, scoring, k, CPU, ngram_min=1,
                                        tokenizer=tokenizer())
        done = engine.generate([Request(str(i), p, constrained(so))
                                for i, p in enumerate(PROMPTS)])
        got = [done[str(i)].output_token_ids for i in range(len(PROMPTS))]
        assert got == expected, f"k={k}"
        if k and proposer == "self":  # the draft is the target, masked alike: all accepted
            assert all(done[str(i)].stats.acceptance_rate == 1.0 for i in range(len(PROMPTS)))


def test_forced_tokens_are_emitted_without_a_forward():
    """Without speculation a step emits one target token: every other token of the output
    is one the grammar forced, appended by the engine with no forward (jump-forward)."""
    engine = build_inprocess_engine(tiny(TARGET), tiny(DRAFT), "multi-query", 0, CPU,
                                    tokenizer=tokenizer())
    seq = engine.generate([Request("r", PROMPTS[0], constrained(SPECS["json_schema"]))])["r"]
    forced = engine.grammars.stats.forced
    assert forced > 0 and seq.stats.completion_tokens == seq.stats.steps + forced
    assert seq.output_token_ids == expected_greedy("json_schema")[0]


def test_logprobs_requests_get_forced_tokens_from_forwards():
    """Jump-forward would leave forced tokens without the model's log-probabilities: such a
    request takes them from forwards, one logprob entry per token, the same output."""
    engine = build_inprocess_engine(tiny(TARGET), tiny(DRAFT), "multi-query", 2, CPU,
                                    tokenizer=tokenizer())
    request = Request("r", PROMPTS[0], constrained(SPECS["json_schema"], logprobs=1))
    engine.add_request(request)
    tokens, entries = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            entries += out.logprobs
    assert engine.grammars.stats.forced == 0
    assert tokens == expected_greedy("json_schema")[0]
    assert [e.token_id for e in entries] == tokens


def test_sampled_json_validates_against_its_schema():
    engine = build_inprocess_engine(tiny(TARGET), tiny(DRAFT), "multi-query", 3, CPU,
                                    tokenizer=tokenizer())
    so = SPECS["json_schema"]
    done = engine.generate([Request(str(i), PROMPTS[i % 3], constrained(
        so, 120, temperature=1.0, seed=i)) for i in range(12)])
    for seq in done.values():
        assert seq.output_token_ids[-1] == EOS, "cut by max_tokens"
        jsonschema.validate(json.loads(bytes(seq.output_token_ids[:-1])), SCHEMA)


class MixtureProposer(SpeculativeProposer):
    """A draft that knows no grammar: each position proposes from q = 1/2 on `bad` (a token
    the grammar never allows) + 1/2 uniform over `good`, independent of the context."""

    def __init__(self, bad: int, good: list[int]):
        self.q = torch.zeros(VOCAB)
        self.q[bad] = 0.5
        self.q[good] = 0.5 / len(good)
        self.gen = torch.Generator().manual_seed(0)

    def get_proposals(self, req) -> SpeculativeProposals:
        B, k = len(req.seq_group_metadata_list), req.num_lookahead_slots
        ids = torch.multinomial(self.q, B * k, replacement=True, generator=self.gen)
        return SpeculativeProposals(ids.view(B, k), self.q.expand(B, k, VOCAB).clone(),
                                    torch.full((B,), k, dtype=torch.long))


def test_sampled_tokens_follow_the_masked_target_with_a_draft_that_breaks_the_grammar():
    """First token from the target's prompt step, second from a speculative step whose
    draft proposes a disallowed token half of the time (and allowed ones otherwise): the
    pairs follow the target's masked, renormalised distribution (chi-square, fixed seeds)."""
    so = StructuredOutput("regex", "[a-d][a-d]")
    target = tiny(TARGET)
    worker = ModelWorker(ModelRunner(target, CPU), "target", Grammars(compiler()))
    engine = SpecDecodeEngine(MixtureProposer(ord("z"), [ord(c) for c in "abcd"]),
                              make_scorer("multi-query", worker), max_model_len=256,
                              num_speculative_tokens=2, grammars=Grammars(compiler()))
    params = dict(temperature=1.0)
    n, draws, draft_tokens = 2000, [], 0
    for start in range(0, n, 500):  # batches of 500 sequences
        done = engine.generate([Request(str(i), PROMPTS[0], constrained(so, 2, seed=i, **params))
                                for i in range(start, start + 500)])
        draws += [tuple(s.output_token_ids) for s in done.values()]
        draft_tokens += sum(s.stats.draft_tokens for s in done.values())
    assert draft_tokens > 0  # second tokens went through rejection sampling
    expected = masked_pair_probs(target, PROMPTS[0], so, SamplingParams(**params))
    assert all(d in expected for d in draws), "a token the grammar does not allow"
    assert chi_square_pvalue(draws, expected) > 1e-3
