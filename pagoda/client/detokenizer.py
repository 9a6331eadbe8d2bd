"""Incremental detokenization and stop strings, one request at a time (client side).

Each new token is decoded inside a small window of token strings instead of the whole output:

    tokens:  ... | prefix_offset ............ read_offset ........ end |
                   |<- already emitted text ->|<- new tokens ------>|
    delta = text(tokens[prefix_offset:]) minus text(tokens[prefix_offset:read_offset])

The window starts a few tokens back so that a token's text can depend on its left neighbour
(leading spaces, merges). While the window's text ends in U+FFFD, a multi-byte UTF-8 character
is still incomplete: nothing is emitted and the window grows until the character is complete.
"""

from __future__ import annotations

from typing import Any

from pagoda.sampling_params import SamplingParams

# Prompt tokens decoded as left context; the first delta starts after them.
_PROMPT_CONTEXT = 5


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token's text on its own (for logprob entries); special tokens are kept."""
    return str(tokenizer.decode([token_id]))


class IncrementalDetokenizer:
    """Output text of one request, with stop strings and stream deltas (vLLM's semantics).

    `update` appends tokens and returns the stop string when one is hit; the text is then cut
    before the stop string (after it with include_stop_str_in_output) and the request is
    finished. Stop strings are only looked for once more than `min_tokens` tokens are out.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None
        self._text = ""
        self._returned = 0  # output_text[:_returned] went out through get_delta
        self._skip_ids: set[int] = _special_ids(tokenizer) if params.skip_special_tokens else set()
        self._slow = not getattr(tokenizer, "is_fast", False)
        self._added_vocab: set[str] = set(tokenizer.get_added_vocab()) if self._slow else set()
        # Text that may still become part of a stop string is held back from streaming.
        hold = params.max_stop_len - 1 if not params.include_stop_str_in_output else 0
        self._stop_buffer = max(hold, 0)

        context = [t for t in prompt_token_ids[-_PROMPT_CONTEXT - 2 :] if t not in self._skip_ids]
        self._tokens: list[str] = [tokenizer.convert_ids_to_tokens(t) for t in context]
        self._prefix_offset = max(len(self._tokens) - _PROMPT_CONTEXT, 0)
        self._read_offset = len(self._tokens)
        self._prefix_text = self._to_string(self._tokens[self._prefix_offset :])

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def finished(self) -> bool:
        """True once a stop string was hit."""
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string if one was hit, else None.

        stop_terminated: the last token is EOS or one of stop_token_ids (the engine stopped on
        it); its text is left out unless include_stop_str_in_output, as in vLLM.
        Once a stop string has been hit, later tokens are ignored (and None is returned).
        """
        if self.stop_reason is not None:
            return None  # tokens still in flight when the stop string aborted the request
        self.token_ids.extend(new_token_ids)
        if not self.params.detokenize:
            return None
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        old_len = len(self._text)
        for token_id in new_token_ids:
            if token_id not in self._skip_ids:
                self._tokens.append(self.tokenizer.convert_ids_to_tokens(token_id))
                self._text += self._decode_next()
        if self.params.stop and len(self.token_ids) > self.params.min_tokens:
            self.stop_reason = self._find_stop(old_len)
        return self.stop_reason

    def get_delta(self, finished: bool = False) -> str:
        """Text not returned before. While the request runs (neither `finished` nor stopped),
        the last max-stop-length - 1 characters are held back: they may start a stop string."""
        end = len(self._text)
        if not (finished or self.finished):
            end -= self._stop_buffer
        if end <= self._returned:
            return ""
        delta = self._text[self._returned : end]
        self._returned = end
        return delta

    def decode_token(self, token_id: int) -> str:
        """One token's text on its own (for logprob entries); special tokens are kept."""
        return decode_token(self.tokenizer, token_id)

    def _decode_next(self) -> str:
        new_text = self._to_string(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(self._prefix_text) :]
        # Slide the window: the tokens just emitted become the next prefix.
        del self._tokens[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._tokens)
        self._prefix_text = self._to_string(self._tokens)
        return delta

    def _find_stop(self, old_len: int) -> str | None:
        """Earliest stop string that overlaps text added since `old_len`; truncates the text."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            index = self._text.find(stop, max(old_len - len(stop) + 1, 0))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self._text = self._text[:end]
        return stop

    def _to_string(self, tokens: list[str]) -> str:
        if not self._slow:
            return str(self.tokenizer.convert_tokens_to_string(tokens))
        # Slow tokenizers: added tokens bypass the model's decoder and are joined as vLLM does.
        parts: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in self._added_vocab:
                if run:
                    parts.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(token)
            else:
                run.append(token)
        if run:
            parts.append(self.tokenizer.convert_tokens_to_string(run))
        sep = " " if self.params.spaces_between_special_tokens else ""
        return sep.join(parts)


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids that `decode(skip_special_tokens=True)` drops: the named special tokens and every
    added token flagged special (all_special_ids alone misses the latter)."""
    ids = set(tokenizer.all_special_ids)
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return ids
