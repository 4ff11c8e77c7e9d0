"""A batch input file read line by line in chunks: offsets, numbers, long lines, a resumed cursor."""

import asyncio

import pytest

from gateway.batch_input import file_lines

DATA = b"\xef\xbb\xbf{\"a\": 1}\r\n\n  \n" + b"x" * 50 + b"\n{\"b\": 2}\n{\"c\": 3}"


def read_lines(data: bytes, **kw):
    async def read(offset: int, size: int) -> bytes:
        return data[offset:offset + size]

    async def collect():
        return [line async for line in file_lines(read, len(data), **kw)]

    return asyncio.run(collect())


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 2**20])
def test_lines_numbers_and_offsets_are_the_same_whatever_the_chunk(chunk):
    lines = read_lines(DATA, max_bytes=20, chunk_bytes=chunk)
    assert [(x.number, x.raw) for x in lines] == [(1, b'{"a": 1}'), (4, None), (5, b'{"b": 2}'), (6, b'{"c": 3}')]
    assert lines[1].size == 50  # the long line is measured, not held
    assert [DATA[x.start:x.end] for x in lines[2:]] == [b'{"b": 2}\n', b'{"c": 3}']
    assert lines[0].start == 0 and lines[-1].end == len(DATA)


@pytest.mark.parametrize("chunk", [2, 5, 2**20])
def test_a_cursor_resumes_at_the_next_line(chunk):
    first = read_lines(DATA, max_bytes=20, chunk_bytes=chunk)
    third = first[2]
    again = read_lines(DATA, offset=third.start, number=third.number - 1, max_bytes=20, chunk_bytes=chunk)
    assert [(x.number, x.raw) for x in again] == [(5, b'{"b": 2}'), (6, b'{"c": 3}')]
