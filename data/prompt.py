"""The prompt is data: how a dataset row's question becomes the text the policy sees.

A system turn and a user turn go through the tokenizer's chat template (``apply_chat_template`` with the
generation prompt); a tokenizer without a template gets them as plain text, system turn first. Recipe keys
(``data.*``):

* ``system_prompt``: the system turn's text; ``system_prompt_file``: the same from a text file. Neither set: the
  row's task's own system prompt (``data.task``, or an evaluation set's ``task``: rewards/registry.py). An empty
  string means no system turn.
* ``prompt_file``: a text file with the user turn's template; ``{question}`` is replaced by the row's question
  (the only placeholder). Not set: the question itself.

``PromptFormat.from_config`` reads the files once, before any worker starts (a missing file or a template
without ``{question}`` is a ConfigError naming the key).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from configs.schema import ConfigError, DataCfg

QUESTION = "{question}"


@dataclass(frozen=True)
class PromptFormat:
    system_prompt: str | None = None  # None: the row's task's own system prompt ("" = no system turn)
    user_template: str = QUESTION

    @classmethod
    def from_config(cls, data: DataCfg) -> PromptFormat:
        system = data.system_prompt
        if data.system_prompt_file is not None:
            system = _read(data.system_prompt_file, "data.system_prompt_file")
        template = QUESTION
        if data.prompt_file is not None:
            template = _read(data.prompt_file, "data.prompt_file")
            if QUESTION not in template:
                raise ConfigError(f"data.prompt_file: {data.prompt_file} has no {QUESTION} placeholder (where the "
                                  "row's question goes)")
        return cls(system_prompt=system, user_template=template)

    def system_for(self, task: str) -> str:
        """The system turn for a row of ``task`` (the recipe's, else the task's own)."""
        if self.system_prompt is not None:
            return self.system_prompt
        from rewards.registry import get_task

        return get_task(task).system_prompt

    def render(self, tokenizer, question: str, task: str) -> str:
        """The prompt text of one question (chat template with the generation prompt)."""
        system, user = self.system_for(task), self.user_template.replace(QUESTION, question)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n\n".join(m["content"] for m in messages) + "\n\n"


def _read(path: str, key: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{key}: {path} does not exist (or is not a file)")
    return p.read_text()
