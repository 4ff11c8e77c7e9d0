"""A plain Celery app whose tasks a real Celery worker runs as the callbacks of GPU tasks.

``SLUICEWAY_TEST_CELERY_URL`` names its broker and result backend; ``config`` is what the GPU
worker takes as ``--celery-config``: the routes that send these tasks to ``callbacks``.
"""

import os

from celery import Celery

URL = os.environ.get("SLUICEWAY_TEST_CELERY_URL", "redis://127.0.0.1:6379/0")
CALLBACK_QUEUE = "callbacks"


class config:  # noqa: N801 -- a Celery configuration object
    task_routes = {"canvas.*": {"queue": CALLBACK_QUEUE}}
    result_extended = True


app = Celery("canvas", broker=URL, backend=URL)
# NOTE: shared=False on the tasks: this module is imported again for each broker URL, and a
# shared task is added to every app the process finalizes later (Celery then warns that the
# name is registered twice)
app.config_from_object(config)
app.conf.update(accept_content=["json"], task_serializer="json", result_serializer="json")


@app.task(name="canvas.aggregate", shared=False)
def aggregate(results):
    """The chord body: how many results and their completion tokens."""
    return {"n": len(results), "tokens": sum(r["usage"]["completion_tokens"] for r in results)}


@app.task(name="canvas.postprocess", shared=False)
def postprocess(result, suffix="!"):
    """A chain step after a generation."""
    return result["text"].upper() + suffix


@app.task(name="canvas.on_error", shared=False)
def on_error(task_id):
    """A ``link_error`` errback (Celery's one-argument form): records the failed task id."""
    import redis

    redis.Redis.from_url(URL).rpush("canvas:errors", task_id)
    return task_id


class events_config(config):  # noqa: N801
    worker_send_task_events = True
