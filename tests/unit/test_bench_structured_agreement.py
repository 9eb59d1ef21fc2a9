"""tools/bench/structured_agreement.py's classes of a reply's tokens: where in the JSON each one sits."""

from collections import Counter

from tools.bench.structured_agreement import json_classes, table


def test_each_token_is_classed_by_where_it_sits_in_the_json():
    pieces = ["```json\n", '{"', "title", '":', ' "', "Rain", " falls", '",', ' "n', '": ', "7", "}", "\n```"]
    assert json_classes(pieces) == [
        "outside",  # the fence, before the object
        "json",  # the brace and a key's quote
        "json",  # the key
        "json",
        "json",  # a value's opening quote
        "string",
        "string",
        "string",  # the closing quote is the value's
        "json",
        "json",
        "json",  # a number
        "json",  # the closing brace
        "outside",  # after the object
    ]


def test_brackets_quotes_and_escapes_inside_a_string_are_its_text():
    pieces = ['{"points": ["', "a ]}", '\\"', " {", '"]}']  # the value: a ]}\" {
    assert json_classes(pieces) == ["json", "string", "string", "string", "string"]
    assert json_classes(['{"a": ["x"', ", ", '"y"]}', " tail"]) == ["string", "json", "string", "outside"]


def test_the_table_counts_the_drafted_positions_without_the_forced_ones():
    tally = {("string", "n"): 4, ("string", "agree"): 3, ("forced", "n"): 6, ("forced", "agree"): 6}
    row = table({"JSON schema": Counter(tally)}).splitlines()[2]
    assert row.startswith("| JSON schema | 4 | 0.750 | 4, 0.750 | - | - | 6, 1.000 |")
