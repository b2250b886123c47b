"""Helpers shared by test modules (imported as ``from helpers import ...``; pytest puts tests/ on sys.path)."""

import torch

from specresearch.drafts.feature import FeatureHead, FeatureHeadConfig


def feature_head(model, layers=(1, -1), seed=1, scale=0.05, head_tokens=None) -> FeatureHead:
    """A feature head on the transformers ``model``, moved away from its identity-like initialisation by
    seeded noise of std ``scale``: a draft that differs from the target. ``head_tokens``: a trained
    vocabulary-subset head over the first ``head_tokens`` ids."""
    ids = None if head_tokens is None else torch.arange(head_tokens)
    head = FeatureHead(model, FeatureHeadConfig("t", feature_layers=layers, head_tokens=head_tokens,
                                                train_head=head_tokens is not None), head_token_ids=ids, seed=seed)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in head.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn_like(p))
    return head


def close_draft(noise: float = 0.1):
    """A tiny Llama draft: the target ``tiny_llama(48, seed=0, init_std=0.6)`` with seeded noise of ``noise`` times
    each weight's std, close enough that drafts are accepted."""
    from specresearch.models.toy import tiny_llama

    draft = tiny_llama(48, seed=0, init_std=0.6)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=generator) * p.std())
    return draft


def markov_toy(seed: int, vocab: int = 6):
    """A Markov ``ToyLM`` from ``exact.random_rational_model`` (some zero probabilities): its rows in float64."""
    import random

    from specresearch import exact
    from specresearch.models.toy import ToyLM

    model = exact.random_rational_model(vocab, random.Random(seed), depth=1, zero_prob=0.2)
    return ToyLM(torch.tensor([[float(p) for p in model((t,))] for t in range(vocab)], dtype=torch.float64).log())


class ToyChatTokenizer:
    """Chat-templates a turn into ids 2..31 of a 32-token vocabulary (one id a character), EOS 1."""

    eos_token_id = 1

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return [2 + ord(c) % 30 for c in messages[0]["content"]]


def visible_from_parents(parents):
    """A tree's ``visible [1, n, n]`` (each node sees itself and its ancestors) from parent indices (-1: none)."""
    from specresearch.models.probe import tree_visibility

    return tree_visibility(parents)


def tree_path(tokens, parents, i) -> list[int]:
    """The tokens from the root to node ``i`` of a tree (``tokens`` one row, ``parents`` indices, -1: none)."""
    from specresearch.models.probe import tree_path as path

    return [int(token) for token in path(list(tokens), i, parents)]


def reads_per_step(run, lengths=(12, 36)) -> dict[str, float]:
    """Host reads a step of ``run(max_new_tokens)`` (a generation call), by whose code made them and in all, as the
    difference between a long and a short run (so a call's one-off reads cancel): ``engine.timing.HostReads``."""
    from specresearch.engine.timing import HostReads

    counts, steps = [], []
    for tokens in lengths:
        with HostReads() as reads:
            out = run(tokens)
        counts.append({**reads.by_origin, "all": reads.count})
        steps.append(len(out.steps))
    return {where: (counts[1].get(where, 0) - counts[0].get(where, 0)) / (steps[1] - steps[0])
            for where in ("specresearch", "other", "all")}


def explain_static_calls(lm):
    """``torch._dynamo.explain`` of a static model's calls in a captured step, two left-padded rows: a chain of 3
    tokens, commit, a 4-node tree with its visibility, keep its path. ``lm``: a ``StaticCausalLM``, allocated here."""
    from specresearch.engine.prompts import encode_prompts

    ids, mask = encode_prompts([[5, 9, 3, 7], [4, 8]])
    lm.allocate(2, 32)
    lm.prefill(ids, mask)
    tokens = torch.tensor([[3, 4, 5, 6], [6, 5, 4, 3]])
    depth = torch.tensor([[0, 1, 1, 2]]).expand(2, -1)
    parents = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    visible = torch.tensor(parents, dtype=torch.bool)[None].expand(2, -1, -1)

    def calls():
        chain, _ = lm.forward(tokens[:, :3])
        lm.commit(torch.tensor([2, 1]))
        tree, _ = lm.forward(tokens, depth=depth, visible=visible)
        lm.keep_path(torch.tensor([[0, 1, 3], [0, 2, 0]]), torch.tensor([3, 2]))
        return chain, tree

    return torch._dynamo.explain(calls)()



def check_captured_step(target, draft, prompts, options: dict, steps: int = 3) -> None:
    """The captured step of ``speculative_generate(target, draft, prompts, **options)`` (``engine.static``): at T = 0
    ``torch._dynamo.explain`` finds one graph and no break (what ``torch.compile(fullgraph=True)`` and a CUDA graph
    need: no host read inside), and at T = 1 the step compiled (``fullgraph=True``, the ``aot_eager`` backend:
    dynamo's graph and its functionalised in-place updates) writes the eager step's log over ``steps`` steps from the
    same uniforms; a warm-up gives back what the step changes (:func:`check_warm_up_gives_back`)."""
    from specresearch.config import SamplingConfig
    from specresearch.engine.prompts import encode_prompts
    from specresearch.engine.static import plan_for, start_run

    ids, mask = encode_prompts(prompts)
    plan = plan_for(options.get("verifier", "block"), options["gamma"], options.get("num_drafts", 1),
                    options.get("draft_law", "iid"), options.get("tree_nodes"))

    def run(sampling):
        return start_run(target, draft, ids, mask, plan=plan, sampling=sampling, max_new_tokens=10,
                         steps_per_read=steps)

    def log(compiled: bool) -> torch.Tensor:
        started = run(SamplingConfig())
        step = torch.compile(started.step, fullgraph=True, dynamic=False, backend="aot_eager") if compiled else started.step
        generator = torch.Generator().manual_seed(0)
        for _ in range(steps):
            started.state.uniforms.copy_(torch.rand(started.state.uniforms.shape, generator=generator,
                                                    dtype=torch.float64))
            step()
        return started.state.log.clone()

    explained = torch._dynamo.explain(run(SamplingConfig(temperature=0.0)).step)()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert torch.equal(log(False), log(True))
    check_warm_up_gives_back(target, draft, prompts, options, steps)


def refed_static_form(target, draft, prompts, refed: int):
    """``draft``'s static form (a feature reader with its own ``refeed``: a block drafter, P-EAGLE) after the
    left-padded ``prompts`` whose last ``refed`` tokens are re-fed as one call, each with the target's features of the
    slot before it, as the captured loop's re-feed reads them. -> (the static form, the re-feed's logits ``[B, refed,
    V]``, its predictions)."""
    from specresearch.engine.prompts import encode_prompts

    ids, mask = encode_prompts(prompts)
    _, features = target.prefill(ids, mask, hidden_layers=draft.feature_layers)
    before = torch.zeros(*ids.shape, draft.feature_size)
    before[:, 1:] = features[:, :-1] * mask[:, :-1, None]
    static = draft.static_form()
    static.allocate(len(prompts), 64)
    static.prefill(ids, mask, leave=refed, inputs=static.fuse(before[:, :-refed]))
    logits, predictions = static.refeed(ids[:, -refed:], inputs=static.fuse(before[:, -refed:]))
    return static, logits, predictions


def check_warm_up_gives_back(target, draft, prompts, options: dict, steps: int = 3) -> None:
    """A captured step's warm-up (``engine.captured.warm_up``: what the CUDA graph and inductor runners do before they
    capture or compile) gives back every extent the step changes (``_Run.small_state``, nested drafts' ``held_rows``
    too): after it, ``steps`` eager steps at T = 1 write the log a run without it writes."""
    from specresearch.config import SamplingConfig
    from specresearch.engine.captured import warm_up
    from specresearch.engine.prompts import encode_prompts
    from specresearch.engine.static import plan_for, start_run

    ids, mask = encode_prompts(prompts)
    plan = plan_for(options.get("verifier", "block"), options["gamma"], options.get("num_drafts", 1),
                    options.get("draft_law", "iid"), options.get("tree_nodes"))
    logs = []
    for warmed in (False, True):
        run = start_run(target, draft, ids, mask, plan=plan, sampling=SamplingConfig(), max_new_tokens=10,
                        steps_per_read=steps)
        if warmed:
            warm_up(run.step, run.small_state())
        generator = torch.Generator().manual_seed(0)
        for _ in range(steps):
            run.state.uniforms.copy_(torch.rand(run.state.uniforms.shape, generator=generator, dtype=torch.float64))
            run.step()
        logs.append(run.state.log.clone())
    assert torch.equal(*logs)
