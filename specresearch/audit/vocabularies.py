"""transformers' speculative decoding across vocabularies, as the execution audit predicts its law (engine
``transformers-usd`` of :mod:`specresearch.audit.execute`).

transformers 5.25's ``UniversalSpeculativeDecodingGenerator`` (``generate(assistant_model=draft, tokenizer=...,
assistant_tokenizer=..., do_sample=True)``; Timor et al. 2025, token-level intersection) drafts with a model of another
vocabulary, kept to the tokens both vocabularies share, and verifies with ``_speculative_sampling``. Facts read from its
``candidate_generator.py`` (our code, their facts):

* the shared tokens are matched by string (``AssistantToTargetTranslator``);
* the draft's context: its first call decodes the target's ids (special tokens skipped) and encodes the text with the
  draft's tokenizer; each later token is its shared draft token, or its text re-encoded;
* its drafts are warped by the temperature twice (the draft's ``generate`` builds its own processors and is handed
  the main ones too), as in transformers' other assisted decoding: softmax(z / T^2);
* where the draft has tokens the target lacks, transformers prunes the draft's head to the shared tokens in the order
  one call of the draft tokenizer's ``get_vocab()`` lists them (a hash order, drawn anew at each call; the
  translator, built once per tokenizer pair and process, keeps it) and writes the pruned logits to the target's ids
  in the order of the draft's ids (``get_target_logits``): the token drafted is right, the q it is verified with is
  the draft's law on other tokens' ids.

:class:`CrossVocabularyDraft` computes, after a prompt and prefix, the draft's own law d and the q transformers
verifies with, from an untouched copy of the draft (transformers prunes the one it runs in place) and the order its
translator drew.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["CrossVocabularyDraft"]


class CrossVocabularyDraft:
    """A draft of another vocabulary as transformers runs it (module docstring).

    Args:
        draft_model: the transformers draft, before transformers first runs it (a copy is kept).
        tokenizers: ``(target tokenizer, draft tokenizer)``.
        vocab: the target's vocabulary size (the rows' width).
        temperature: the run's sampling temperature.
    """

    def __init__(self, draft_model, tokenizers, vocab: int, temperature: float):
        if len(tokenizers) != 2 or any(t is None for t in tokenizers):
            raise ValueError("transformers-usd needs tokenizer= (the target's) and assistant_tokenizer=")
        self.target_tokenizer, self.draft_tokenizer = tokenizers
        target_vocab, draft_vocab = (t.get_vocab() for t in tokenizers)
        self.to_draft = {target_vocab[w]: i for w, i in draft_vocab.items() if w in target_vocab}
        self.own_only = len(draft_vocab) - len(self.to_draft)  # the draft's tokens the target lacks
        self.lossy = self.own_only > 0  # transformers prunes the draft's head: q permuted
        self.vocab, self.temperature = vocab, temperature
        self.own_draft = copy.deepcopy(draft_model)

    def columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the target id of each column of the draft's pruned head, the target id transformers writes it to), the
        columns' order read from transformers' translator for these tokenizers (built by the run's first
        ``generate``); both the shared tokens in the draft's id order where nothing is pruned."""
        from transformers.generation.candidate_generator import AssistantVocabTranslatorCache

        written = torch.tensor(sorted(self.to_draft, key=self.to_draft.get))
        if not self.lossy:
            return written, written
        translator = AssistantVocabTranslatorCache._cache[self.target_tokenizer][self.draft_tokenizer]
        to_target = {index: token for token, index in self.to_draft.items()}
        return torch.tensor([to_target[int(a)] for a in translator.assistant_overlap_token_ids.tolist()]), written

    def context(self, prompt: list[int], prefix) -> list[int]:
        """The draft's own tokens after ``prompt`` and ``prefix`` (target ids), as the candidate generator builds them."""
        def encoded(ids):
            text = self.target_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)
            return self.draft_tokenizer(text, add_special_tokens=False)["input_ids"]

        ids = encoded(prompt)
        for token in prefix:
            ids += [self.to_draft[token]] if token in self.to_draft else encoded([token])
        return ids

    @torch.no_grad()
    def rows(self, prompt: list[int], prefixes) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, q) ``[n, V]`` float64 on the target's ids after each prefix: d the law the draft drafts its next token
        from (its logits on :meth:`context`, kept on the shared tokens, softmax(z / T^2)), q what transformers verifies
        with (d's entries written to other tokens' ids where it prunes)."""
        pruned, written = self.columns()
        draft_columns = torch.tensor([self.to_draft[t] for t in pruned.tolist()])
        d_rows, q_rows = [], []
        for prefix in prefixes:
            ids = torch.tensor([self.context(prompt, prefix)], device=self.own_draft.device)
            logits = self.own_draft(ids).logits[0, -1].double().cpu()
            law = (logits[draft_columns] / self.temperature ** 2).softmax(-1)  # the pruned head's columns
            d, q = torch.zeros(self.vocab, dtype=torch.float64), torch.zeros(self.vocab, dtype=torch.float64)
            d[pruned], q[written] = law, law
            d_rows.append(d)
            q_rows.append(q)
        return torch.stack(d_rows), torch.stack(q_rows)
