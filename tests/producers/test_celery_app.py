"""The Celery signature apps send: validated, named, routed, and on the broker as JSON."""

import base64
import json

import pytest

from producers.celery_app import CELERY_QUEUE, TASK_NAME, generate_signature
from producers.errors import InvalidJob

celery = pytest.importorskip("celery")


def test_signature_fields():
    sig = generate_signature(prompt="hi", sampling={"max_tokens": 4}, metadata={"user": 7})
    assert sig.task == TASK_NAME and sig.options["queue"] == CELERY_QUEUE == "sluiceway"
    assert sig.kwargs["prompt"] == "hi" and sig.kwargs["sampling"]["max_tokens"] == 4
    assert sig.kwargs["metadata"] == {"user": 7} and "id" not in sig.kwargs and "v" not in sig.kwargs
    with pytest.raises(InvalidJob, match="temperature"):
        generate_signature(prompt="hi", sampling={"temperature": "hot"})


def test_apply_async_puts_a_json_message_on_the_redis_queue(redis_server, redis_client):
    app = celery.Celery("app", broker=redis_server, backend=redis_server)
    result = generate_signature(messages=[{"role": "user", "content": "hi"}], app=app).apply_async()
    (raw,) = redis_client.lrange(CELERY_QUEUE, 0, -1)
    message = json.loads(raw)
    assert message["headers"]["task"] == TASK_NAME and message["headers"]["id"] == result.id
    assert message["content-type"] == "application/json"
    args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
    assert args == [] and kwargs["messages"] == [{"role": "user", "content": "hi"}]
    app.close()
