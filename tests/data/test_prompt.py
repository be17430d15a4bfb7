"""The prompt is data (data/prompt.py): the recipe's system prompt or template file, else the task's own, through
the tokenizer's chat template."""
import pytest

from configs.schema import ConfigError, config_from_dict
from data.prompt import PromptFormat
from rewards.registry import get_task


class ChatTok:
    """A tokenizer with a chat template: renders the turns so the test can read them back."""

    chat_template = "x"

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class PlainTok:
    chat_template = None


def _fmt(**data):
    return PromptFormat.from_config(config_from_dict({"data": data}).data)


def test_defaults_are_the_tasks_own_system_prompt_and_the_question():
    out = _fmt().render(ChatTok(), "1 + 2?", "arithmetic")
    assert out == f"<system>{get_task('arithmetic').system_prompt}<user>1 + 2?<assistant>"


def test_system_prompt_and_template_file(tmp_path):
    sys_file, tpl = tmp_path / "system.txt", tmp_path / "user.txt"
    sys_file.write_text("Think step by step.")
    tpl.write_text("Question: {question}\nAnswer in a box.")
    assert _fmt(system_prompt="Be brief.").render(ChatTok(), "q", "addition") == "<system>Be brief.<user>q<assistant>"
    out = _fmt(system_prompt_file=str(sys_file), prompt_file=str(tpl)).render(ChatTok(), "2 + 2?", "addition")
    assert out == "<system>Think step by step.<user>Question: 2 + 2?\nAnswer in a box.<assistant>"
    assert _fmt(system_prompt="").render(ChatTok(), "q", "addition") == "<user>q<assistant>"  # no system turn
    assert _fmt(system_prompt="S").render(PlainTok(), "q", "addition") == "S\n\nq\n\n"  # no chat template


def test_bad_prompt_keys_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.system_prompt_file: .*not both"):
        config_from_dict({"data": {"system_prompt": "a", "system_prompt_file": "b"}})
    with pytest.raises(ConfigError, match=r"^data.prompt_file: .*nope.txt does not exist"):
        _fmt(prompt_file=str(tmp_path / "nope.txt"))
    (tmp_path / "t.txt").write_text("no placeholder")
    with pytest.raises(ConfigError, match=r"^data.prompt_file: .*no \{question\} placeholder"):
        _fmt(prompt_file=str(tmp_path / "t.txt"))


def test_the_embedded_chat_prompt_is_unchanged():
    """The embedded tokenizer's prompt through PromptFormat is the text the SFT warm start trained on."""
    from dataclasses import replace

    from embedded.tiny_model import TinyModelSpec, build_tokenizer, chat_prompt

    tok = build_tokenizer(replace(TinyModelSpec(), tokenizer_corpus_size=200))
    system = get_task("addition").system_prompt
    expected = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "7 + 5"}],
                                       tokenize=False, add_generation_prompt=True)
    assert chat_prompt(tok, "7 + 5", "addition") == expected == _fmt().render(tok, "7 + 5", "addition")
