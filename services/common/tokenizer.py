"""The model's own tokenizer, where prompts become token ids: once, at load (torch-free).

The controller renders each row's whole conversation (system, user, earlier turns) with
the model's chat template through transformers' `apply_chat_template`, and sends the ids;
rollout servers never tokenize a prompt. Both ends load the tokenizer of one model path,
and `fingerprint` says whether two loaded tokenizers are the same: a rollout server
refuses a request made with another (docs/architecture.md, "The prompt path").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.errors import DapoError, one_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, str]
# Rendered and encoded into the fingerprint: two tokenizers that agree on the vocabulary
# but render or split these differently would give the engine different prompts.
PROBE: list[Message] = [
    {"role": "system", "content": "Reason step by step."},
    {"role": "user", "content": "What is 3 + 4? \\frac{1}{2} ∑ 答え 🙂"},
]


class PromptTokenizer:
    """A row's messages → the prompt's token ids, as the policy sees them.

    `chat`: through the chat template with the generation prompt (`controller.
    apply_chat_template`); else the single user turn's text, encoded without specials.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, source: str, chat: bool) -> None:
        self.tokenizer, self.source, self.chat = tokenizer, source, chat

    @cached_property
    def fingerprint(self) -> str:
        """What a rollout server compares with its own (computed once, when first asked)."""
        return fingerprint(self.tokenizer)

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt's text: the chat template's output, or the raw user turn."""
        if not self.chat:
            return raw_turn(messages)
        return str(
            self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
        )

    def ids(self, messages: Sequence[Message]) -> list[int]:
        """The prompt's token ids (ValueError with the tokenizer's words when it fails)."""
        try:
            if not self.chat:
                return list(self.tokenizer.encode(raw_turn(messages), add_special_tokens=False))
            return list(
                self.tokenizer.apply_chat_template(
                    list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        except Exception as exc:  # a template that raises, or refuses these roles
            raise ValueError(f"cannot render the prompt: {one_line(str(exc))}") from None


def raw_turn(messages: Sequence[Message]) -> str:
    """The text of a single user turn (controller.apply_chat_template=false takes no more)."""
    if len(messages) != 1 or messages[0]["role"] != "user":
        roles = ", ".join(m["role"] for m in messages)
        raise ValueError(
            f"the prompt holds turns {roles}, but controller.apply_chat_template is false "
            "(raw prompts are one user turn; set it true to render the conversation)"
        )
    return messages[0]["content"]


def fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of what decides a prompt's ids: vocabulary, chat template, and the ids
    of a probe conversation (equal across processes and library versions that agree)."""
    template = tokenizer.chat_template or ""
    probe = tokenizer.encode(" ".join(m["content"] for m in PROBE), add_special_tokens=False)
    if template:
        probe += [-1] + list(
            tokenizer.apply_chat_template(
                PROBE, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    state = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "template": template,
        "probe": [int(i) for i in probe],
    }
    return hashlib.sha256(json.dumps(state, ensure_ascii=False).encode()).hexdigest()[:16]


def load_tokenizer(model_path: str | Path | None, chat: bool) -> PromptTokenizer:
    """The tokenizer of `model_path` (shared.model_path), or a one-line DapoError: no
    model path, no tokenizer there, or a chat template asked of a model without one."""
    if model_path is None:
        raise DapoError("shared.model_path is not set: prompts are tokenized with its tokenizer")
    model = Path(model_path)
    if not model.is_dir():
        raise DapoError(f"shared.model_path {model}: model directory not found")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # "None of PyTorch ... found": expected here
        tokenizer = tokenizer_class(model).from_pretrained(str(model))
    except ImportError:
        raise DapoError("tokenizing prompts needs the `transformers` package") from None
    except Exception as exc:  # transformers raises several types for a missing tokenizer
        raise DapoError(f"{model}: cannot load its tokenizer: {one_line(str(exc))}") from None
    if chat and not tokenizer.chat_template:
        raise DapoError(
            f"controller.apply_chat_template is true but {model} has no chat template "
            "(set controller.apply_chat_template=false for raw prompts)"
        )
    return PromptTokenizer(tokenizer, str(model), chat)


def tokenizer_class(model: Path) -> type[PreTrainedTokenizerBase]:
    """The class `tokenizer_config.json` names (what AutoTokenizer would pick), else the
    generic fast tokenizer: AutoTokenizer reads the model's config first, and that import
    brings in torch wherever torch is installed; the controller stays torch-free."""
    import transformers

    try:
        name = json.loads((model / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    name = name if isinstance(name, str) else "PreTrainedTokenizerFast"
    found = getattr(transformers, name, None)  # probe-ok: a class the model's file names
    if isinstance(found, type) and issubclass(found, transformers.PreTrainedTokenizerBase):
        return found
    return transformers.PreTrainedTokenizerFast
