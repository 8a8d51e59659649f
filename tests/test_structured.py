"""Structured output: every reply parses under its schema / regex / grammar, jump-forward changes nothing but
the number of steps (same greedy tokens, same sampled distribution), and bad constraints give one error line."""

import json
import re

import pytest
import torch

from llmrun.errors import LlmrunError
from llmrun.generate import Engine
from llmrun.grammar import ANY_JSON, GrammarSpec, compile_grammar, grammar_spec
from llmrun.grammar_checks import JUMP_FORWARD_MAX, endless_rule, forced_bound, schema_patterns
from llmrun.sampling import SamplingParams, token_probs
from llmrun.speculative import DraftLength, ModelDrafter, NgramDrafter, Speculator

from .conftest import run_main
from .test_speculative import _assert_cache_matches_a_fresh_prefill, _chi_square_p_value

pytest.importorskip("xgrammar")  # a dependency; absent only where no package index is reachable (the GPU device)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "pets", "member"],
    "additionalProperties": False,
}
PERSON_PROMPT = "Describe a made-up person as JSON with name, age, city, pets and member."


def _valid_person(doc) -> bool:
    """The schema above, checked by hand (not by the grammar under test)."""
    return (isinstance(doc, dict) and set(doc) == set(PERSON["properties"])
            and isinstance(doc["name"], str) and len(doc["name"]) <= 24
            and type(doc["age"]) is int and 0 <= doc["age"] <= 120
            and isinstance(doc["city"], str) and len(doc["city"]) <= 24
            and isinstance(doc["pets"], list) and len(doc["pets"]) <= 3 and set(doc["pets"]) <= {"cat", "dog", "fish"}
            and isinstance(doc["member"], bool))


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2, max_len=1024)


def _reply(engine, prompt: str, spec, params: SamplingParams, *, jump_forward=True, speculator=None, chat=True):
    engine.reset()
    engine.speculator = speculator
    engine.grammar = None if spec is None else compile_grammar(spec, engine.tokenizer, engine.model.config.vocab_size, jump_forward)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else engine.tokenizer.encode(prompt)
    reply = engine.generate(ids, params)
    text = "".join(reply)
    engine.grammar = engine.speculator = None
    return reply, text


def _json_spec(schema) -> object:
    return grammar_spec(json_schema=json.dumps(schema))


# --- every output is in the language ------------------------------------------------------------------------


def test_sampled_replies_validate_against_their_schema(engine):
    spec = _json_spec(PERSON)
    for seed in range(8):
        reply, text = _reply(engine, PERSON_PROMPT, spec, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=120))
        assert reply.stats.finish_reason == "stop", text
        assert _valid_person(json.loads(text)), text


def test_any_json_gives_a_json_value(engine):
    for seed in range(4):
        reply, text = _reply(engine, "List three fruits in JSON.", grammar_spec(json_schema=ANY_JSON),
                             SamplingParams(temperature=0.9, seed=seed, max_new_tokens=200))
        if reply.stats.finish_reason == "stop":
            json.loads(text)
        else:  # out of tokens mid-document: still a prefix the grammar allowed
            assert reply.stats.finish_reason == "length" and text.lstrip()[:1] in '{["-0123456789tfn'


@pytest.mark.parametrize("pattern", [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{5,40}\.", r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}"])
def test_sampled_replies_match_their_regex(engine, pattern):
    for seed in range(4):
        reply, text = _reply(engine, "Answer briefly: is the sky blue?", grammar_spec(regex=pattern),
                             SamplingParams(temperature=1.0, seed=seed, max_new_tokens=60))
        assert reply.stats.finish_reason == "stop" and re.fullmatch(pattern, text), text


@pytest.mark.parametrize("spec, pattern", [
    (grammar_spec(json_schema='{"const": "é"}'), '"é"'),  # forced text after a character's first bytes
    (grammar_spec(json_schema='{"type": "object", "properties": {"ñandú": {"const": 100}}, "required": ["ñandú"]}'),
     r'\{"ñandú": 100\}'),
    (grammar_spec(regex="ñandú [0-9]"), "ñandú [0-9]"),
    (grammar_spec(regex="[😀-😂]{2}"), "[😀-😂]{2}"),
], ids=["const", "key", "regex", "emoji"])
@pytest.mark.parametrize("jump_forward", [True, False])
def test_non_ascii_constraints(engine, spec, pattern, jump_forward):
    for seed in range(2):
        reply, text = _reply(engine, "Is it?", spec, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=30),
                             jump_forward=jump_forward)
        assert reply.stats.finish_reason == "stop" and re.fullmatch(pattern, text), text


@pytest.mark.parametrize("pattern", [r"[^\s\S]", r"ab[^\s\S]"])
def test_a_constraint_with_nothing_to_follow_is_one_error(engine, pattern):
    with pytest.raises(LlmrunError, match="allows nothing to follow here"):
        _reply(engine, "Is it?", grammar_spec(regex=pattern), SamplingParams(temperature=0, max_new_tokens=10))
    engine.grammar = None


def test_what_xgrammar_does_not_enforce_is_a_warning(smollm2):
    schema = {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.25}}}
    grammar = compile_grammar(_json_spec(schema), smollm2.tokenizer, smollm2.config.vocab_size)
    assert any("multipleOf" in w for w in grammar.warnings), grammar.warnings
    grammar = compile_grammar(grammar_spec(regex="(ab|cd)$x"), smollm2.tokenizer, smollm2.config.vocab_size)
    assert any("'$'" in w and "ignored" in w for w in grammar.warnings), grammar.warnings
    assert compile_grammar(_json_spec(PERSON), smollm2.tokenizer, smollm2.config.vocab_size).warnings == ()


EBNF = r'''
root ::= item (", " item)? (", " item)? (", " item)? "."
item ::= quantity " " fruit
quantity ::= [1-9] [0-9]?
fruit ::= "apples" | "pears" | "plums"
'''


def test_replies_follow_an_ebnf_grammar(engine, tmp_path):
    path = tmp_path / "fruit.gbnf"
    path.write_text(EBNF)
    spec = grammar_spec(grammar=str(path))
    for seed in range(6):
        reply, text = _reply(engine, "What is in the basket?", spec, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=60))
        assert reply.stats.finish_reason == "stop", text
        assert re.fullmatch(r"[1-9][0-9]? (apples|pears|plums)(, [1-9][0-9]? (apples|pears|plums)){0,3}\.", text), text


def test_control_tokens_never_appear_inside_the_grammar(engine):
    """<|im_start|> spells text a free-form string would allow; it must stay markup, masked out."""
    grammar = compile_grammar(grammar_spec(regex=r"[^\n]*"), engine.tokenizer, engine.model.config.vocab_size)
    constraint = grammar.start()
    logits = constraint.constrain(torch.zeros(engine.model.config.vocab_size))
    special = engine.tokenizer.special_ids()
    stops = sorted(engine.tokenizer.eos_ids)
    assert special and all(logits[i] == float("-inf") for i in special if i not in stops)
    assert all(logits[i] == 0 for i in stops)  # the regex may end here: the reply may stop


# --- jump-forward changes the step count, not the output -----------------------------------------------------


@pytest.mark.parametrize("prompt,spec", [
    (PERSON_PROMPT, _json_spec(PERSON)),
    ("Give the capital of France as JSON.", _json_spec({"type": "object", "properties": {"country": {"const": "France"}, "capital": {"type": "string"}}, "required": ["country", "capital"]})),
    ("Write the date of the moon landing.", grammar_spec(regex=r"The date is (January|February|March|April|May|June|July|August|September|October|November|December) [1-9][0-9]?, [0-9]{4}\.")),
])
def test_jump_forward_output_is_plain_constrained_greedy_output(engine, prompt, spec):
    params = SamplingParams(temperature=0, max_new_tokens=100)
    plain, plain_text = _reply(engine, prompt, spec, params, jump_forward=False)
    jumped, jumped_text = _reply(engine, prompt, spec, params)
    assert jumped.token_ids == plain.token_ids and jumped_text == plain_text
    assert plain.stats.forced_proposed == 0
    assert jumped.stats.forced > 0 and jumped.stats.decode_steps < plain.stats.decode_steps
    assert jumped.stats.as_dict()["sampled_tokens"] == jumped.stats.new_tokens - jumped.stats.forced


def test_constrained_speculation_is_lossless(engine):
    spec = _json_spec(PERSON)
    params = SamplingParams(temperature=0, max_new_tokens=100)
    plain, _ = _reply(engine, PERSON_PROMPT, spec, params, jump_forward=False)
    for speculator in (Speculator(NgramDrafter(3), DraftLength(4, adaptive=False)),
                       Speculator(ModelDrafter(Engine(engine.loaded, engine.max_len, model=engine.model.with_layers([0, 1, 28, 29])), "skip"),
                                  DraftLength(3, adaptive=False))):
        for jump in (False, True):
            reply, _ = _reply(engine, PERSON_PROMPT, spec, params, jump_forward=jump, speculator=speculator)
            assert reply.token_ids == plain.token_ids
            _assert_cache_matches_a_fresh_prefill(engine)  # rejected and cut-off drafts left no trace
        assert reply.stats.drafted > 0 or reply.stats.forced > 0


def test_constrained_chat_reuses_the_cache_across_turns(engine):
    from llmrun.conversation import Conversation

    engine.reset()
    engine.grammar = compile_grammar(_json_spec(PERSON), engine.tokenizer, engine.model.config.vocab_size)
    try:
        chat = Conversation(engine, SamplingParams(temperature=0, max_new_tokens=100))
        held = 0
        for question in (PERSON_PROMPT, "Another one, older.", "And a third."):
            reply = chat.send(question)
            text = "".join(reply)
            chat.finish(reply)
            assert _valid_person(json.loads(text)), text
            # all of the last turn is reused, its reply too, although the grammar's splits are not the
            # tokenizer's own (tokenizing the reply's text again gives other ids)
            assert reply.stats.reused_tokens == held
            held = len(reply.prompt) + len(reply.token_ids)
        assert engine.tokenizer.encode(text) != reply.token_ids
    finally:
        engine.grammar = None


# --- sampling with jump-forward keeps the constrained distribution ---------------------------------------------


LETTERS = "abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    """A tiny random model whose tokenizer has the letters plus a few merges ('ab', 'abc', 'xy'): a forced
    text can be split several ways, and jump-forward proposes only one of them."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from llmrun.loading import load_model
    from llmrun.tokenizer import Tokenizer

    from .tiny import CONFIGS, random_model, write_hf_dir

    loaded = load_model(str(write_hf_dir(tmp_path_factory.mktemp("letters"), random_model(CONFIGS["llama"], seed=3))), "cpu", "fp32")
    vocab_size = loaded.model.config.vocab_size
    vocab = {c: i for i, c in enumerate(LETTERS)} | {"ab": 26, "bc": 27, "abc": 28, "xy": 29}
    vocab |= {f"Q{i}": i for i in range(30, vocab_size - 1)} | {"<eos>": vocab_size - 1}
    merges = [("a", "b"), ("b", "c"), ("ab", "c"), ("x", "y")]
    tok = HfTokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = Tokenizer(tok, kind="bpe", bos_id=None, eos_id=vocab_size - 1,
                          eos_ids=[vocab_size - 1], add_bos=False, chat_template=None)
    assert tokenizer.encode("abcxy") == [28, 29]
    engine = Engine(loaded, 64)
    engine.tokenizer = tokenizer
    return engine


def _constrained_sequence_probs(engine, grammar, prompt, params, length):
    """The exact probability of every complete reply under the grammar-masked distribution, by full forwards."""
    eos = engine.tokenizer.eos_id
    out, done = {(): 1.0}, {}
    for _ in range(length):
        nxt = {}
        for seq, pr in out.items():
            constraint = grammar.start()
            for t in seq:
                constraint.accept(t)
            with torch.no_grad():
                logits = engine.model(torch.tensor([prompt + list(seq)]))[0, -1]
            for t, pt in enumerate(token_probs(constraint.constrain(logits), params).tolist()):
                if pt > 0:
                    (done if t == eos else nxt)[seq + (t,)] = pr * pt
        out = nxt
    assert not out, "a reply longer than the enumeration"
    return done


def test_jump_forward_sampling_keeps_the_constrained_distribution(letters):
    engine = letters
    spec = grammar_spec(regex="[ab]abcxy[ab]")
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=12)
    grammar = compile_grammar(spec, engine.tokenizer, engine.model.config.vocab_size)
    prompt = [3, 1, 4]
    exact = _constrained_sequence_probs(engine, grammar, prompt, params, 9)
    cells = sorted(exact)
    assert len(cells) > 10  # the forced 'abcxy' has many tokenizations: the model picks among them
    engine.grammar = grammar
    counts, runs = torch.zeros(len(cells), dtype=torch.float64), 1500
    for seed in range(runs):
        engine.reset()
        reply = engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed}))
        assert "".join(reply)[1:6] == "abcxy"
        counts[cells.index((*reply.token_ids, engine.tokenizer.eos_id))] += 1
    engine.grammar = None
    assert reply.stats.forced_proposed > 0
    probs = torch.tensor([exact[c] for c in cells], dtype=torch.float64)
    assert _chi_square_p_value(counts, probs) > 1e-3
    # power: always taking the proposed split (committing the forced tokens unverified) is told apart
    committed = torch.tensor([exact[c] if (28 in c and 29 in c) else 0.0 for c in cells], dtype=torch.float64)
    committed = committed / committed.sum() * runs
    assert _chi_square_p_value(committed.round(), probs) < 1e-6


def test_a_raw_vocabulary_is_read_as_its_own_text(tmp_path):
    from llmrun.tokenizer import tokenizer_from_hf_dir

    from .tiny import _tiny_tokenizer_json

    (tmp_path / "tokenizer.json").write_text(_tiny_tokenizer_json(32))  # WordLevel: neither byte-level nor '▁'
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    tokenizer = tokenizer_from_hf_dir(tmp_path)
    assert tokenizer.kind == "raw"
    constraint = compile_grammar(grammar_spec(regex="w1w2"), tokenizer, 32).start()
    assert torch.isfinite(constraint.constrain(torch.zeros(32))).nonzero().flatten().tolist() == [1]


# --- options and errors ----------------------------------------------------------------------------------------


def test_a_grammar_file_with_a_byte_order_mark(smollm2, tmp_path):
    (tmp_path / "bom.gbnf").write_bytes(b'\xef\xbb\xbfroot ::= "yes" | "no"')
    spec = grammar_spec(grammar=str(tmp_path / "bom.gbnf"))
    assert spec.source == 'root ::= "yes" | "no"'
    compile_grammar(spec, smollm2.tokenizer, smollm2.config.vocab_size)


def test_grammar_spec_reads_inline_files_and_the_any_keyword(tmp_path, monkeypatch):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(PERSON))
    assert grammar_spec(json_schema=str(path)).source == json.dumps(PERSON)
    assert grammar_spec(json_schema='{"type": "integer"}').origin == "(inline)"
    assert grammar_spec(json_schema="true").origin == "(inline)"  # JSON, though not an object
    (tmp_path / "true").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert grammar_spec(json_schema="true").source == "{}"  # a file of that name wins
    assert grammar_spec(json_schema=ANY_JSON).describe() == "any JSON"
    assert grammar_spec() is None


@pytest.mark.parametrize("kwargs,message", [
    (dict(json_schema="{}", regex="a"), "--json-schema and --regex each constrain the output"),
    (dict(json_schema="missing.json"), "--json-schema missing.json: no such file"),
    (dict(json_schema="{not json"), "is not valid JSON"),
    (dict(json_schema="[" * 100_000), "is not valid JSON: nested too deeply to parse"),  # (no file of that name)
    (dict(regex=""), "--regex is empty"),
    (dict(grammar="nowhere.gbnf"), "--grammar nowhere.gbnf: no such file"),
    (dict(grammar="/"), "--grammar / is a directory; give a text file"),
    (dict(json_schema='{"type": "integer", "minimum": 1e400}'), "holds a number that is not finite"),
    (dict(json_schema='{"enum": [NaN]}'), "holds a number that is not finite"),
])
def test_bad_constraint_options_are_one_line_errors(kwargs, message):
    with pytest.raises(LlmrunError, match=re.escape(message)):
        grammar_spec(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(json_schema='{"type": "objec"}'), 'JSON schema (inline): Unsupported type "objec"'),
    (dict(regex="[a-"), "regex '[a-': Regex parsing error at position 4: Unclosed '['"),
    (dict(json_schema='{"anyOf": []}'), "JSON schema (inline) matches no JSON value"),
    (dict(json_schema='{"type": "object", "minProperties": 1}'), "JSON schema (inline): minProperties is greater than"
     " the number of properties, but additional properties aren't allowed: 1 > 0 (a schema's objects get only the"
     " properties it lists, unless additionalProperties allows more)"),
])
def test_uncompilable_constraints_are_one_line_errors(smollm2, kwargs, message):
    with pytest.raises(LlmrunError) as e:
        compile_grammar(grammar_spec(**kwargs), smollm2.tokenizer, smollm2.model.config.vocab_size)
    assert str(e.value) == message


SELF_REQUIRED = {"$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}}, "required": ["k"]}},
                 "$ref": "#/$defs/n"}


@pytest.mark.parametrize("spec,message", [
    (("ebnf", 'root ::= "a" root'), "grammar g matches no text of finite length"),
    (("ebnf", 'root ::= "x" | "y" loop\nloop ::= "a" loop'), "grammar g: its rule loop matches no text of finite length"),
    (("ebnf", 'root ::= a\na ::= b "x"\nb ::= a | "y" c\nc ::= "z" c+'), "grammar g matches no text of finite length"),
    (("ebnf", 'root ::= "a" root{1,3}'), "grammar g matches no text"),
    (("json", SELF_REQUIRED), "JSON schema (inline) matches no JSON value of finite length"),
    (("json", {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/n"}], "$defs": SELF_REQUIRED["$defs"]}), "matches no JSON value of finite length (every way"),
    (("json", {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}}, "$ref": "#/$defs/n"}),
     "matches no JSON value of finite length"),
])
def test_a_constraint_with_no_finite_ending_is_refused(smollm2, spec, message):
    """Each lets a reply into a rule it can never leave; jump-forward's search of such a rule's one continuation
    never ended (it took all memory). Each is refused before the reply starts."""
    kind, source = spec
    spec = _json_spec(source) if kind == "json" else GrammarSpec("ebnf", source, "g")
    with pytest.raises(LlmrunError, match=re.escape(message)):
        compile_grammar(spec, smollm2.tokenizer, smollm2.config.vocab_size)


@pytest.mark.parametrize("spec", [
    ("ebnf", 'root ::= "a" root | "b"'), ("ebnf", 'root ::= "(" root ")" | "x"'), ("ebnf", 'root ::= "a" root*'),
    ("ebnf", 'root ::= "a" root{0,2}'), ("ebnf", 'root ::= "a" root?'),
    ("json", {"$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}),
    ("json", {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"}),
])
def test_recursion_with_a_way_out_compiles(smollm2, spec):
    kind, source = spec
    spec = _json_spec(source) if kind == "json" else GrammarSpec("ebnf", source, "g")
    grammar = compile_grammar(spec, smollm2.tokenizer, smollm2.config.vocab_size)
    assert grammar.jump_forward and grammar.warnings == ()


def test_every_form_xgrammar_prints_is_read():
    """The endless-rule check reads xgrammar's printout of each kind of constraint (strings, classes, lookahead
    assertions, repetition ranges, Regex(...) calls, non-ASCII), finding no endless rule where there is none."""
    import xgrammar as xgr

    schemas = [{}, PERSON, {"type": "string", "format": "email"}, {"type": "string", "format": "date-time"},
               {"type": "string", "pattern": "^x+[)(\\]\\\"]$"}, {"type": "array", "items": {"type": "number"}, "minItems": 2},
               {"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "propertyNames": {"pattern": "^a"}},
               {"enum": ["a\"b", "c::=d", "(|)", "é😀"]}, {"type": "integer", "minimum": -5, "maximum": 1234}]
    grammars = [xgr.Grammar.from_json_schema(json.dumps(s), any_whitespace=False) for s in schemas]
    grammars += [xgr.Grammar.from_regex(r) for r in ["[😀-😂]{2}(ab|cd)+x?[0-9]{3,5}", r"\d+(\.\d+)?", "(a|b)*c{0,}",
                                                     r"[^\s\S]", "[\\]\\-]\"+"]]
    grammars += [xgr.Grammar.builtin_json_grammar(), xgr.Grammar.from_ebnf(EBNF)]
    for grammar in grammars:
        assert endless_rule(str(grammar)) is None, str(grammar)
        assert 0 < forced_bound(str(grammar)) < JUMP_FORWARD_MAX, str(grammar)
    assert endless_rule('root ::= (("a" x))\nx ::= (("b" root))\n') == "root"
    assert endless_rule('root ::= (("a") | (x))\nx ::= (([b]* x)) (=("c"))\n') == "x"
    assert endless_rule('root ::= (("a" x{0, 0}))\nx ::= (("b" x))\n') is None  # never entered
    assert endless_rule('root ::= (("a" x{0, 1}))\nx ::= (("b" x))\n') == "x"  # may be entered, never left
    assert endless_rule('root ::= (("a" x{3}))\nx ::= ((x))\n') == "root"
    with pytest.raises(ValueError):
        endless_rule('root ::= (("a" $))')


def test_a_long_forced_text_is_tokenized_only_as_far_as_the_block_reaches(smollm2, monkeypatch):
    """`"ab"{30000}` forces 60,000 characters; a block of 8 tokens needs a few hundred of them."""
    tokenizer = smollm2.tokenizer
    grammar = compile_grammar(GrammarSpec("ebnf", 'root ::= "x" "ab"{30000}', "g"), tokenizer, smollm2.config.vocab_size)
    assert grammar.jump_forward
    whole = tokenizer.encode("x" + "ab" * 30000, special=False, add_bos=False)
    seen = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    assert grammar.start().forced_tokens(tokenizer, 8) == whole[:8]
    assert seen and max(seen) <= 9 * tokenizer.longest_token < 2000


def test_forced_bound_reads_lengths_counts_choices_and_recursion():
    """The longest run a state can force, bounded from the printout: literals' lengths summed along a sequence,
    the largest alternative, a repetition of at least m its body m times plus one iteration when more may follow,
    nothing more for a rule within itself, a lookahead nothing, a Regex call by its pattern's counts."""
    assert forced_bound('root ::= (("ab" [c] x{3}))\nx ::= (("def"))\n') == 2 + 1 + 3 * 3
    assert forced_bound('root ::= (("a") | ("bcd" x*))\nx ::= (("xy"))\n') == 5  # the star: one iteration
    assert forced_bound('root ::= (("a" x{2, 5} x?))\nx ::= (("xy"))\n') == 1 + 3 * 2 + 2
    assert forced_bound('root ::= (("(" root ")") | ("x"))\n') == 2  # (a recursion passes a choice each level)
    assert forced_bound('root ::= (("ab")) (=("cdefgh"))\n') == 2
    assert forced_bound('root ::= ((r))\nr ::= Regex("x{5000}", json_string=true)\n') == 7 * 5000
    assert forced_bound('root ::= ((r{99999871, 99999871}))\nr ::= ((", " "1"))\n') == 3 * 99999871


def test_forced_bound_of_a_chain_of_thousands_of_rules():
    """A large schema's or grammar's chain of rules (each naming the next) passed Python's recursion limit: a
    RecursionError traceback instead of a reply."""
    chain = "".join(f'r{i} ::= (("x" r{i + 1}))\n' for i in range(3000)) + 'r3000 ::= (("end"))\n'
    assert forced_bound(chain, "r0") == 3000 + 3


@pytest.mark.parametrize("spec, longest", [
    (("regex", "((a{1000}){1000}){1000}"), "1,000,000,000"),  # took ~200 MB/s, deaf to signals, until the OOM killer
    (("regex", "a{3000000}"), "3,000,000"),
    (("json", '{"type": "array", "items": {"const": 1}, "minItems": 100000000, "maxItems": 100000000}'),
     "300,000,000"),
    (("ebnf", 'root ::= "x" "ab"{40000}'), "80,001"),
])
def test_a_constraint_that_can_force_a_long_run_turns_jump_forward_off(smollm2, spec, longest):
    """xgrammar's search for the forced text builds the whole run every step: past JUMP_FORWARD_MAX characters
    jump-forward is off for that constraint, with a warning; the reply is constrained as before."""
    kind, source = spec
    grammar = compile_grammar(GrammarSpec(kind, source, "(inline)"), smollm2.tokenizer, smollm2.config.vocab_size)
    assert not grammar.jump_forward and grammar.start().forced_tokens(smollm2.tokenizer, 8) == []
    assert grammar.warnings == (f"jump-forward is off for this constraint: it can force up to {longest} characters"
                                f" in a row, which the search for them would build whole at every step",)


def test_cli_a_long_forced_run_is_a_warning_not_a_runaway(monkeypatch, capsys):
    """The helper's case: a reply of 5 tokens under a regex forcing 10^9 characters, in seconds (it took memory at
    ~200 MB/s inside one C call until the OOM killer)."""
    code, out, err = run_main(["generate", "--regex", "((a{1000}){1000}){1000}", "--temperature", "0", "-n", "5",
                               "-q", "x"], monkeypatch, capsys)
    assert code == 0 and out == "aaaaa\n", (out, err)
    assert "warning: regex '((a{1000}){1000}){1000}': jump-forward is off for this constraint: it can force up to 1,000,000,000" in err


@pytest.mark.parametrize("spec", [("regex", "a{60000}"), ("regex", "[a-z]{0,100000}"),
                                  ("json", '{"type": "object", "properties": {"a": {"type": "string", "maxLength":'
                                           ' 100000}}, "required": ["a"]}')])
def test_long_but_unforced_or_short_runs_keep_jump_forward(smollm2, spec):
    kind, source = spec
    grammar = compile_grammar(GrammarSpec(kind, source, "(inline)"), smollm2.tokenizer, smollm2.config.vocab_size)
    assert grammar.jump_forward and grammar.warnings == ()
    assert JUMP_FORWARD_MAX == 1 << 16


@pytest.mark.parametrize("spec, count", [
    (("regex", "a{4294967298}"), "4294967298"),  # enforced as a{2}, without a word
    (("regex", "(ab){2,4294967297}"), "4294967297"),
    (("regex", "a{999999999999999999999999999999}"), "999999999999999999999999..."),
    (("ebnf", 'root ::= "a"{2147483648}'), "2147483648"),
    (("json", '{"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{4294967298}$"}}}'),
     "4294967298"),
    (("json", '{"type": "object", "patternProperties": {"^x{3000000000}$": {}}}'), "3000000000"),
])
def test_a_repetition_count_past_32_bits_is_refused(smollm2, spec, count):
    """xgrammar reads a count past 2^31 - 1 modulo 2^32: refused before it compiles."""
    kind, source = spec
    with pytest.raises(LlmrunError, match=re.escape(f"repetition count {count} is too large (at most 2,147,483,647)")):
        compile_grammar(GrammarSpec(kind, source, "(inline)"), smollm2.tokenizer, smollm2.config.vocab_size)


@pytest.mark.parametrize("data", ["const", "default", "enum", "examples"])
def test_a_pattern_inside_a_schemas_data_is_not_read_as_a_regex(smollm2, data):
    """A "pattern" key in a const/default/enum/examples value is data: its text is no regex, its counts no limit."""
    value = {"pattern": "^a{4294967298}$", "patternProperties": {"^x{3000000000}$": 1}}
    document = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^b{2}$"}},
                data: [value] if data in ("enum", "examples") else value}
    assert schema_patterns(document) == ["^b{2}$"]
    named = {"type": "object", "properties": {data: {"type": "string", "pattern": "^a{4294967298}$"}}}
    assert schema_patterns(named) == ["^a{4294967298}$"]  # a property of that name is a schema
    with pytest.raises(LlmrunError, match="repetition count 4294967298 is too large"):
        compile_grammar(GrammarSpec("json", json.dumps(named), "(inline)"), smollm2.tokenizer, smollm2.config.vocab_size)
    compile_grammar(GrammarSpec("json", json.dumps(document), "(inline)"), smollm2.tokenizer, smollm2.config.vocab_size)


@pytest.mark.parametrize("spec", [("regex", "[{4294967298}]"), ("regex", r"\{4294967298\}"),
                                  ("ebnf", 'root ::= "{4294967298}"'), ("regex", "a{2147483647}")])
def test_text_that_only_looks_like_a_large_count_compiles(smollm2, spec):
    kind, source = spec
    compile_grammar(GrammarSpec(kind, source, "(inline)"), smollm2.tokenizer, smollm2.config.vocab_size)


def test_a_printout_the_check_cannot_read_turns_jump_forward_off(smollm2, monkeypatch):
    import llmrun.grammar

    def unreadable(text):
        raise ValueError("unexpected")

    monkeypatch.setattr(llmrun.grammar, "endless_rule", unreadable)
    grammar = compile_grammar(grammar_spec(regex="a+b"), smollm2.tokenizer, smollm2.config.vocab_size)
    assert not grammar.jump_forward and grammar.start().forced_tokens(smollm2.tokenizer, 8) == []
    assert grammar.warnings == ("jump-forward is off for this constraint: llmrun could not read its compiled rules",)


@pytest.mark.parametrize("schema,warnings", [
    ({"type": "object", "required": ["zz"]},
     ["'required' names 'zz', which 'properties' does not define: only the properties a schema lists are written"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^z": {}}, "required": ["a", "zz"]}, []),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}, "else": {"type": "string"}}, ["keyword 'if'"]),
    ({"type": "array", "items": {"type": "array", "uniqueItems": True, "contains": {"const": 1}}},
     ["keyword 'contains'", "keyword 'uniqueItems'"]),
    ({"type": "object", "properties": {"not": {"type": "object", "properties": {"a": {"type": "integer"}},
                                               "dependentRequired": {"a": ["b"]}}}},
     ["keyword 'dependentRequired'"]),  # a property named "not" is a name, not the keyword
    ({"anyOf": [{"$ref": "#/$defs/d"}, {"type": "null"}], "$defs": {"d": {"not": {"required": ["q"]}}}}, ["keyword 'not'"]),
    (PERSON, []),
])
def test_keywords_xgrammar_ignores_are_warned_of(smollm2, schema, warnings):
    grammar = compile_grammar(_json_spec(schema), smollm2.tokenizer, smollm2.config.vocab_size)
    assert sorted(grammar.warnings) == sorted(f"{w} (not enforced)" for w in warnings)


def test_a_grammar_that_does_not_parse_is_a_one_line_error(smollm2, tmp_path):
    path = tmp_path / "bad.gbnf"
    path.write_text('root ::= "a" | undefined\n')
    with pytest.raises(LlmrunError) as e:
        compile_grammar(grammar_spec(grammar=str(path)), smollm2.tokenizer, smollm2.model.config.vocab_size)
    assert str(e.value) == f'grammar {path}: EBNF parser error at line 1, column 16: Rule "undefined" is not defined'


def test_bare_json_schema_means_any_json():
    from llmrun.cli.options import expand_bare_options

    assert expand_bare_options(["chat", "--json-schema"]) == ["chat", "--json-schema=any"]
    assert expand_bare_options(["chat", "--json-schema", "--temperature", "0"])[1] == "--json-schema=any"
    assert expand_bare_options(["chat", "--json-schema", "-"]) == ["chat", "--json-schema", "-"]
    assert expand_bare_options(["chat", "--json-schema", "s.json", "--ngram"]) == ["chat", "--json-schema", "s.json", "--ngram=3"]
    assert expand_bare_options(["generate", "--ngram", "1.5", "x"]) == ["generate", "--ngram", "1.5", "x"]  # an error, not a model


def test_cli_json_schema_end_to_end(monkeypatch, capsys, tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    code, out, err = run_main(["chat", "-p", PERSON_PROMPT, "--json-schema", path, "--temperature", "0", "--json"], monkeypatch, capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert _valid_person(json.loads(doc["text"]))
    assert doc["forced_tokens"] > 0 and doc["sampled_tokens"] + doc["forced_tokens"] == doc["new_tokens"]
    assert doc["mask_us_per_token"] > 0
    code, out, err = run_main(["generate", "--regex", r"[0-9]+", "--temperature", "0", "-n", "8", "-q", "2 + 2 ="], monkeypatch, capsys)
    assert code == 0 and re.fullmatch(r"[0-9]+\n", out), (out, err)


@pytest.mark.parametrize("args,message,exit_code", [
    (["--json-schema", '{"type": "objec"}'], 'error: JSON schema (inline): Unsupported type "objec"', 1),
    (["--regex", "(", "--grammar", "g.gbnf"],
     "error: --regex and --grammar each constrain the output; pass one of them (see: llmrun chat --help)", 2),
])
def test_cli_bad_constraints_give_one_line_errors(monkeypatch, capsys, args, message, exit_code):
    code, out, err = run_main(["chat", "-p", "hi", *args], monkeypatch, capsys)
    assert code == exit_code and out == ""
    assert err.strip() == message


def test_cli_endless_grammar_is_one_line_error(monkeypatch, capsys, tmp_path):
    """The report's case: this took all memory under the default jump-forward."""
    path = tmp_path / "inf.gbnf"
    path.write_text('root ::= "a" root\n')
    code, out, err = run_main(["generate", "x", "--grammar", path, "-n", "10", "-q", "--temperature", "0"], monkeypatch, capsys)
    assert (code, out) == (1, "") and err == (f"error: grammar {path} matches no text of finite length: every way through"
                                              " it runs into a recursion with no way out\n"), err


@pytest.mark.parametrize("args,message", [
    (["generate", "-", "--json-schema", "-"], "the text and the constraint (-) both come from stdin"),
    (["generate", "--json-schema", "-"], "the text and the constraint (-) both come from stdin"),
    (["generate", "smollm2", "-", "--grammar", "-"], "the text and the constraint (-) both come from stdin"),
    (["chat", "--grammar", "-"], "the prompt and the constraint (-) both come from stdin; give the prompt with -p"),
])
@pytest.mark.parametrize("stdin", ['root ::= "a"', "{}", "Once upon a time"])
def test_stdin_read_for_both_the_text_and_the_constraint(monkeypatch, capsys, args, message, stdin):
    """Said before either is read, whatever stdin holds (a text there was read as the schema: 'not valid JSON')."""
    code, out, err = run_main(args, monkeypatch, capsys, stdin=stdin)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
