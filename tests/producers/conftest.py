import pytest

from producers.client import Client
from tests.producers.peer import Peer


@pytest.fixture
def client(redis_server):
    with Client(redis_server) as c:
        yield c


@pytest.fixture
def peer(redis_server):
    p = Peer(redis_server)
    yield p
    p.close()
