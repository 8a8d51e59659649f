"""Conversations on disk, only when asked: `llmrun chat --save/--load`, `/save` and `/load`, on the embedded model."""

import json
import os
import re
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmrun.cli import app
from llmrun.conversation import FORMAT, FORMAT_VERSION, SavedConversation, load_conversation, save_conversation
from llmrun.errors import LlmrunError

from .test_cli import LOAD_S, PROMPT_MARK, QUESTION, Terminal

SHORT = ("--temperature", "0", "-n", "8")


def _chat(*args):
    result = CliRunner().invoke(app, ["chat", *SHORT, *map(str, args)])
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result


def _doc(messages, system=None, model="smollm2", **changes) -> dict:
    return {"format": FORMAT, "version": FORMAT_VERSION, "model": model, "system": system, "messages": messages,
            **changes}


# --- the file format -------------------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    saved = SavedConversation("smollm2", "Be brief.", [{"role": "user", "content": "Ça va ?"},
                                                       {"role": "assistant", "content": "Oui."}])
    save_conversation(tmp_path / "c.json", saved)
    assert load_conversation(tmp_path / "c.json") == saved
    doc = json.loads((tmp_path / "c.json").read_text(encoding="utf-8"))
    assert doc == _doc(saved.messages, "Be brief.")
    assert os.listdir(tmp_path) == ["c.json"]  # the temporary file was renamed into place
    thinking_off = SavedConversation("smollm2", None, [], {"enable_thinking": False})  # --chat-template-kwargs
    save_conversation(tmp_path / "c.json", thinking_off)
    assert load_conversation(tmp_path / "c.json") == thinking_off
    assert json.loads((tmp_path / "c.json").read_text())["chat_template_kwargs"] == {"enable_thinking": False}



def test_a_save_through_a_symbolic_link_replaces_the_file_it_names(tmp_path):
    (tmp_path / "chats").mkdir()
    real, link = tmp_path / "chats" / "real.json", tmp_path / "link.json"
    save_conversation(real, SavedConversation("smollm2", None, []))
    link.symlink_to(real)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    saved = SavedConversation("smollm2", None, messages)
    save_conversation(link, saved)
    assert link.is_symlink() and load_conversation(real) == saved
    assert sorted(os.listdir(tmp_path / "chats")) == ["real.json"]
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "chats" / "nowhere.json")
    with pytest.raises(LlmrunError, match="a symbolic link to a file that does not exist"):
        save_conversation(dangling, saved)
    assert not (tmp_path / "chats" / "nowhere.json").exists()

def test_a_failed_save_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text("before")

    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(LlmrunError, match="cannot save the conversation to .*No space left on device"):
        save_conversation(path, SavedConversation("smollm2", None, []))
    assert path.read_text() == "before"
    assert os.listdir(tmp_path) == ["c.json"]  # no temporary file left behind


BAD_FILES = [
    (None, "no such file"),
    (b"{\"format\":", "is not JSON"),
    (b"[" * 100_000, "is not JSON (nested too deeply to parse)"),
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (b"[1, 2]", "is not an llmrun conversation"),
    (json.dumps({"messages": []}).encode(), "is not an llmrun conversation"),
    (json.dumps(_doc([], version=99)).encode(), "format version 99; this llmrun reads version 1"),
    (json.dumps(_doc("hello")).encode(), "needs \"model\" (text), \"system\" (text or null) and \"messages\" (a list)"),
    (json.dumps(_doc([], model=None)).encode(), "needs \"model\""),
    (json.dumps(_doc([{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}])).encode(),
     "message 1 is not"),
    (json.dumps(_doc([{"role": "user", "content": 3}])).encode(), "message 0 is not"),
    (json.dumps(_doc([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}])).encode(),
     "message 0 is the assistant's; a conversation's messages alternate, the user's first"),
    (json.dumps(_doc([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])).encode(),
     "message 1 is the user's"),
    (json.dumps(_doc([{"role": "user", "content": "a"}])).encode(), "the last message is the user's, with no reply"),
    (json.dumps(_doc([], version=True)).encode(), "format version true; this llmrun"),  # (spelt as JSON)
    # JSON's escapes can spell a lone surrogate, which no tokenizer takes: /load said "loaded", then every turn failed
    (json.dumps(_doc([{"role": "user", "content": "a\ud800b"}, {"role": "assistant", "content": "c"}])).encode(),
     "message 0: the text is not UTF-8 (lone surrogate U+D800 at character 1)"),
    (json.dumps({**_doc([]), "system": "\udc80"}).encode(), "the system prompt: the text is not UTF-8"),
    (b'{"version": 1' + b"0" * 5000 + b"}", "is not JSON (a number has more than 4300 digits)"),  # (no Python advice)
    (json.dumps(_doc([], chat_template_kwargs=[1])).encode(), "chat_template_kwargs must be a JSON object"),
    (json.dumps(_doc([], chat_template_kwargs={"messages": 1})).encode(), "chat_template_kwargs sets messages"),
    (json.dumps(_doc([], chat_template_kwargs={"x": "\ud800"})).encode(), "holds the JSON escape \\ud800"),
]


@pytest.mark.parametrize("content, message", BAD_FILES)
def test_a_bad_file_is_one_error_line_before_the_model_loads(tmp_path, content, message):
    path = tmp_path / "c.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(LlmrunError, match=re.escape(message)):
        load_conversation(path)
    result = CliRunner().invoke(app, ["chat", "--load", str(path), "-p", "hi"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert result.stdout == ""


def test_save_refuses_to_overwrite_a_conversation_it_did_not_load(tmp_path):
    save_conversation(tmp_path / "old.json", SavedConversation("smollm2", None, []))
    (tmp_path / "notes.txt").write_text("{}")
    old = (tmp_path / "old.json").read_text()
    runner = CliRunner()
    result = runner.invoke(app, ["chat", "--save", str(tmp_path / "old.json"), "-p", "hi"])
    assert result.exit_code == 1
    assert "the file exists; continue it with --load" in result.stderr
    assert (tmp_path / "old.json").read_text() == old
    result = runner.invoke(app, ["chat", "--save", str(tmp_path / "notes.txt"), "-p", "hi"])
    assert result.exit_code == 1
    assert "the file exists (and is not a conversation); choose another file" in result.stderr
    assert (tmp_path / "notes.txt").read_text() == "{}"
    result = runner.invoke(app, ["chat", "--save", str(tmp_path / "no" / "c.json"), "-p", "hi"])
    assert result.exit_code == 1 and "no directory" in result.stderr
    if os.path.isdir("/proc"):  # a directory where no file can be made (root may write anywhere else)
        result = runner.invoke(app, ["chat", "--save", "/proc/c.json", "-p", "hi"])
        assert result.exit_code == 1 and "--save /proc/c.json: cannot write in /proc" in result.stderr


# --- chat -p: one turn continued and written back ----------------------------------------------------------------


def test_save_then_load_continues_the_conversation(tmp_path, monkeypatch, smollm2):
    monkeypatch.chdir(tmp_path)
    _chat("-p", QUESTION)
    assert os.listdir(tmp_path) == []  # nothing written without --save

    first = _chat("--system", "You are terse.", "-p", QUESTION, "--save", "c.json")
    assert os.listdir(tmp_path) == ["c.json"]
    doc = json.loads(Path("c.json").read_text())
    answer = first.stdout.removesuffix("\n")
    assert doc == _doc([{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer}],
                       "You are terse.")

    # Continued: the loaded turn and its system prompt are in the prompt, token for token.
    second = json.loads(_chat("--load", "c.json", "--save", "c.json", "-p", "And of Italy?", "--json").stdout)
    expected = smollm2.tokenizer.encode_chat([{"role": "system", "content": "You are terse."}, *doc["messages"],
                                              {"role": "user", "content": "And of Italy?"}])
    assert second["prompt_tokens"] == len(expected)
    again = json.loads(Path("c.json").read_text())
    assert again["messages"] == [*doc["messages"], {"role": "user", "content": "And of Italy?"},
                                 {"role": "assistant", "content": second["text"]}]
    assert again["system"] == "You are terse."
    assert os.listdir(tmp_path) == ["c.json"]

    # --system replaces the saved one; without --save nothing changes on disk.
    third = json.loads(_chat("--load", "c.json", "--system", "Answer in French.", "-p", "Thanks!", "--json").stdout)
    expected = smollm2.tokenizer.encode_chat([{"role": "system", "content": "Answer in French."},
                                              *again["messages"], {"role": "user", "content": "Thanks!"}])
    assert third["prompt_tokens"] == len(expected)
    assert json.loads(Path("c.json").read_text()) == again


def test_the_chat_template_kwargs_are_saved_and_loaded(tmp_path, monkeypatch, smollm2):
    """--chat-template-kwargs goes into the file and comes back with --load (as the system prompt does), unless
    given again; /load takes the file's."""
    from llmrun.tokenizer import Tokenizer

    seen, render = [], Tokenizer.render_chat
    monkeypatch.setattr(Tokenizer, "render_chat", lambda self, m, gen=True, variables=None:
                        seen.append(variables) or render(self, m, gen, variables))
    monkeypatch.chdir(tmp_path)
    _chat("-p", QUESTION, "--save", "c.json", "--chat-template-kwargs", '{"enable_thinking": false}')
    assert json.loads(Path("c.json").read_text())["chat_template_kwargs"] == {"enable_thinking": False}
    _chat("--load", "c.json", "-p", "And of Italy?")
    _chat("--load", "c.json", "-p", "And of Italy?", "--chat-template-kwargs", '{"style": 1}')
    assert seen == [{"enable_thinking": False}, {"enable_thinking": False}, {"style": 1}]


# --- the interactive chat ----------------------------------------------------------------------------------------


def test_repl_saves_every_turn_and_runs_save_and_load(tmp_path):
    auto, copy, bad = tmp_path / "auto.json", tmp_path / "copy.json", tmp_path / "bad.json"
    bad.write_text("not json")
    t = Terminal("chat", *SHORT, "--ctx", "512", "--save", str(auto))
    try:
        assert "/help" in t.expect(PROMPT_MARK, timeout=LOAD_S)
        assert not auto.exists()
        t.send(QUESTION)
        t.expect(PROMPT_MARK)
        first = json.loads(auto.read_text())  # written after the turn, before the next prompt
        assert [m["role"] for m in first["messages"]] == ["user", "assistant"]
        assert first["messages"][0]["content"] == QUESTION

        t.send("/help")
        assert "/save [FILE]" in t.expect(PROMPT_MARK)
        t.send(f"/save {copy}")
        assert f"saved 1 turn to {copy}" in t.expect(PROMPT_MARK)
        assert json.loads(copy.read_text()) == first
        t.send(f"/load {copy}")  # over a conversation --save holds: said, as the next turn writes over it
        assert f"note: {auto} keeps the conversation before this /load until the next turn" in t.expect(PROMPT_MARK)
        t.send("/reset")
        t.expect(PROMPT_MARK)
        t.send(f"/load {bad}")
        assert "error: " in t.expect(PROMPT_MARK)  # and the chat goes on
        t.send(f"/load {copy}")
        assert f"loaded 1 turn from {copy}" in t.expect(PROMPT_MARK)
        t.send("And of Italy?")
        t.expect(PROMPT_MARK)
        t.send("/save")  # no FILE: the last file loaded
        assert f"saved 2 turns to {copy}" in t.expect(PROMPT_MARK)
        t.send(f"/save {bad}")  # a file this session neither loaded nor wrote is left alone
        assert "not this conversation's" in t.expect(PROMPT_MARK) and bad.read_text() == "not json"
        t.send(f"/save {tmp_path}")
        assert "a directory" in t.expect(PROMPT_MARK)
        t.send("/save ''")  # (as a path, "" is ".": it said "/save .: a directory")
        assert "the file name is empty" in t.expect(PROMPT_MARK)
        t.send(f'/save "{tmp_path / "my"} chat".json')  # quoted as a shell would need it
        assert f"saved 2 turns to {tmp_path / 'my chat.json'}" in t.expect(PROMPT_MARK)
        t.proc.kill()  # even killed, it has lost nothing: each turn was on disk before the next prompt
        assert t.wait() == -signal.SIGKILL
        assert "Traceback" not in t.text()
    finally:
        t.close()
    second = json.loads(auto.read_text())
    assert second["messages"][:2] == first["messages"]
    assert [m["content"] for m in second["messages"][::2]] == [QUESTION, "And of Italy?"]
    assert json.loads(copy.read_text()) == second
    assert sorted(os.listdir(tmp_path)) == ["auto.json", "bad.json", "copy.json", "my chat.json"]


def test_a_ctrl_c_as_a_turn_is_saved_loses_nothing(tmp_path, monkeypatch, smollm2):
    """Ctrl-C landing while the turn is kept and saved (the reply just over): the one-shot chat exits 0 and the
    interactive one goes on, the turn saved either way, no half-written file left."""
    import llmrun.cli.chat as chat_cli
    from llmrun import conversation
    from llmrun.conversation import Conversation
    from llmrun.generate import Engine
    from llmrun.sampling import SamplingParams

    real = conversation.save_conversation

    def interrupted(path, saved):
        os.kill(os.getpid(), signal.SIGINT)
        real(path, saved)

    monkeypatch.setattr(conversation, "save_conversation", interrupted)
    result = CliRunner().invoke(app, ["chat", *SHORT, "-p", QUESTION, "--save", str(tmp_path / "one.json")])
    assert result.exit_code == 0, result.stderr
    assert [m["role"] for m in json.loads((tmp_path / "one.json").read_text())["messages"]] == ["user", "assistant"]

    typed = iter([(QUESTION, "message"), ("And of Italy?", "message")])

    def read_message():  # two questions typed, then Ctrl-D
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(chat_cli, "_read_message", read_message)
    chat = Conversation(Engine(smollm2, max_len=256), SamplingParams(temperature=0, max_new_tokens=4))
    chat_cli._repl(chat, True, chat_cli._Saving("smollm2", every_turn=tmp_path / "repl.json"))
    saved = json.loads((tmp_path / "repl.json").read_text())["messages"]
    assert [m["content"] for m in saved[::2]] == [QUESTION, "And of Italy?"]
    assert sorted(os.listdir(tmp_path)) == ["one.json", "repl.json"]


def test_signals_held_drop_ctrl_c_and_deliver_the_others_after():
    from llmrun.cli.console import signals_held

    got = []
    interrupt = signal.getsignal(signal.SIGINT)  # (Python's own handler; SIG_IGN in a shell's background job)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            assert got == []
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGINT) is interrupt  # put back as it was


def test_save_and_load_without_a_file_are_errors():
    from llmrun.cli.chat import _Saving, _slash

    for line, message in (("/save", "/save needs a FILE"), ("/load  ", "/load needs a FILE"),
                          ('/save "my chat.json', "as one word"), ("/load '", "as one word"),
                          ('/save "a" "b"', "as one word")):
        with pytest.raises(LlmrunError, match=message):  # the chat prints it as an `error:` line and goes on
            _slash(line, None, None, _Saving("smollm2"))
