"""The bulk reader's edges: line ends, the size limit to the byte, nesting counted around strings."""

import json

from producers.bulk_input import _BLOCK, MAX_JSON_DEPTH, input_lines, json_depth, parse_line, read_rows


def lines(tmp_path, body: bytes, limit: int):
    path = tmp_path / "in.jsonl"
    path.write_bytes(body)
    return list(input_lines(path, limit))


def test_lines_split_on_newline_only_and_the_limit_holds_to_the_byte(tmp_path):
    body = (b"a\rb\r\n" + b"x" * 10 + b"\n" + b"y" * 10 + b"\r\n" + b"z" * 11 + b"\r\n" + b"w" * 11 + b"\n"
            + b" \t\r\n" + b"v" * 30)
    assert lines(tmp_path, body, 10) == [
        (1, b"a\rb"),  # a raw CR stays inside its line; CRLF loses its CR
        (2, b"x" * 10), (3, b"y" * 10),  # at the limit, with either line end
        (4, 11), (5, 11),  # one byte over: its size, not its bytes
        (7, 30),  # the last line, over the limit and without a line end
    ]
    assert lines(tmp_path, b"\xef\xbb\xbf{}\n\xef\xbb\xbf{}", 10) == [(1, b"{}"), (2, b"\xef\xbb\xbf{}")]


def test_a_long_line_is_read_in_bounded_pieces(tmp_path):
    body = b"[1]\n" + b"q" * (3 * 2**20 + 5) + b"\n[2]\n"
    assert lines(tmp_path, body, 1000) == [(1, b"[1]"), (2, 3 * 2**20 + 5), (3, b"[2]")]


def test_a_crlf_split_between_two_reads_is_one_line_end(tmp_path):
    body = b"x" * (_BLOCK - 1) + b"\r\n[1]\n"  # the first read ends on the "\r"
    assert lines(tmp_path, body, _BLOCK - 1) == [(1, b"x" * (_BLOCK - 1)), (2, b"[1]")]
    assert lines(tmp_path, body, _BLOCK - 2) == [(1, _BLOCK - 1), (2, b"[1]")]


def test_nesting_is_counted_around_strings():
    assert json_depth("[" * 100 + "]" * 100) == 100
    assert json_depth(json.dumps({"prompt": "[" * 500, "m": [[1]] * 40})) == 3
    assert json_depth('{"a": "\\"[[[[", "b": "\\\\", "c": ' + "[" * 70) == 71  # escaped quote, escaped backslash
    assert json_depth('"' + '\\"' * 100_000 + "[" * 70) == 0  # one string to the end, scanned once
    assert json_depth("[" * MAX_JSON_DEPTH) == MAX_JSON_DEPTH


def test_every_line_becomes_a_row_whatever_it_holds(tmp_path):
    """Each of these raised out of the old reader or out of the submission after it."""
    hostile = [
        b'{"prompt": "a", "metadata": {"d": ' + b"[" * 200 + b"]" * 200 + b"}}",  # pydantic: serialization depth
        b'{"prompt": "a\\ud800"}',  # UnicodeEncodeError at submission
        b'{"prompt": "a", "metadata": {"\\udc00": 1}}',  # the same, in a key
        b'{"prompt": "a", "sampling": {"stop": 5}}',  # TypeError inside validation
        b'{"prompt": "a", "deadline": 1e400}',  # a deadline of inf: never expires
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(hostile) + b"\n")
    rows = list(read_rows(path, b"k" * 32))
    assert [(r.line, r.job) for r in rows] == [(n, None) for n in range(1, len(hostile) + 1)]
    assert all(r.error.startswith(f"line {r.line}: ") for r in rows)
    assert parse_line(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}  # a surrogate pair is fine
