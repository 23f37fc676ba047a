"""Prompt lengths in tokens, as a rollout server counts them, without torch or transformers.

The controller and `dapo up` skip prompts longer than `shared.max_prompt_length` at load,
so they must count as the rollout server does, in a torch-free process: the chat template
rendered with jinja2 as transformers renders it, the text encoded with the model's
`tokenizer.json` through `tokenizers`. Without those (the slim image) there is no counter
and the rollout server refuses such a prompt instead (docs/reliability.md, "Data checked
at load").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from services.common.data import DataError

PromptCounter = Callable[[str], int]

SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class CounterUnavailable(Exception):
    """No token counter here (a missing package or file); the message says which."""


def prompt_counter(model_path: str | Path | None, chat: bool) -> PromptCounter:
    """`prompt → token count` as a rollout server serving `model_path` counts it (with the
    chat template when `chat`); CounterUnavailable when it cannot be built here, DataError
    when the model cannot take the prompts at all (chat asked of a model with no template).
    """
    if model_path is None:
        raise CounterUnavailable("no model path (shared.model_path)")
    model = Path(model_path)
    if not (model / "tokenizer.json").is_file():
        raise CounterUnavailable(f"{model}/tokenizer.json not found")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CounterUnavailable("the `tokenizers` package is not installed") from None
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))

    def encode(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    if not chat:
        return encode
    render = chat_renderer(model)
    return lambda prompt: encode(render(prompt))


def chat_renderer(model: Path) -> Callable[[str], str]:
    """One user turn through the model's chat template, with the generation prompt."""
    config = _tokenizer_config(model)
    source = _chat_template(model, config)
    if source is None:
        raise DataError(
            f"controller.apply_chat_template is true but {model} has no chat template "
            "(set controller.apply_chat_template=false for raw prompts)"
        )
    template = _compile(source)
    specials = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name)}

    def render(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        return str(template.render(messages=messages, add_generation_prompt=True, **specials))

    return render


def _tokenizer_config(model: Path) -> dict[str, Any]:
    path = model / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _chat_template(model: Path, config: dict[str, Any]) -> str | None:
    """The template transformers would use: chat_template.jinja, else the config's entry
    (a string, or a list of named templates: `default`)."""
    path = model / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    entry = config.get("chat_template")
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        entry = named.get("default")
    return entry if isinstance(entry, str) else None


def _token_text(value: Any) -> str:
    """A special token as the config stores it: a string, or an AddedToken dict."""
    return str(value["content"]) if isinstance(value, dict) else str(value)


def _compile(source: str) -> Any:
    """A template compiled as transformers compiles chat templates."""
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise CounterUnavailable("the `jinja2` package is not installed") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        options = {"indent": indent, "separators": separators, "sort_keys": sort_keys}
        return json.dumps(x, ensure_ascii=ensure_ascii, **options)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise CounterUnavailable(f"the chat template does not compile here: {exc}") from None
