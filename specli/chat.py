"""Chat templates from GGUF files, rendered in Jinja's immutable sandbox."""

from __future__ import annotations

from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specli.errors import UsageError

# A file without a template gets ChatML, the most common format for small instruct models.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@lru_cache(maxsize=8)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def render_chat(template: str | None, user: str, bos: str = "", eos: str = "",
                system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}]
    return render_messages(template, messages, bos, eos)


def render_messages(template: str | None, messages: list[dict], bos: str = "",
                    eos: str = "") -> str:
    """A conversation through the model's template (ChatML when it has none), ready for the
    assistant's reply."""
    try:
        return _compile(template or FALLBACK_TEMPLATE).render(
            messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
    except Exception as e:  # noqa: BLE001 - the sandbox stops anything worse than a failure
        kind = "" if isinstance(e, TemplateError) else f"{type(e).__name__}: "
        raise UsageError(f"the model's chat template failed: {kind}{e}",
                         hint="run without --chat and format the prompt yourself") from e
