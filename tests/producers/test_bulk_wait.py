"""A bulk run waits on a done signal without taking it: a run that dies mid-wait steals nothing."""

import os
import signal
import subprocess
import sys

from producers.protocol import Keys
from tests.producers.peer import result_for
from tests.producers.test_bulk import queued_ids, wait_for, write_in

K = Keys("sluiceway")


def blocked(clients):
    return any("b" in c["flags"] for c in clients)


def test_a_bulk_run_killed_while_it_waits_leaves_the_done_signal_to_other_waiters(client, peer, redis_server,
                                                                                  tmp_path):
    rows = 5
    write_in(tmp_path / "in.jsonl", [{"prompt": f"q{i}"} for i in range(rows)])
    command = [sys.executable, "-m", "producers.cli", "bulk", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
               "--redis", redis_server, "--no-progress"]
    bulk = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: client.redis.xlen(K.queue("bulk")) == rows, what="the rows submitted")
        ids = queued_ids(client)
        for head in ids:  # each attempt ends the row the run waits for first
            peer.wait_blocked(1)
            os.kill(bulk.pid, signal.SIGSTOP)
            # NOTE: the check and the job's end are one transaction: if the stopped run is
            # blocked on the done list at the check, this very push is what wakes it.
            with peer.redis.pipeline(transaction=True) as pipe:
                pipe.client_list()
                pipe.hset(K.job(head), mapping={"status": "done", "result": result_for(head).model_dump_json()})
                pipe.rpush(K.done(head), "done")
                was_blocked = blocked(pipe.execute()[0])
            if was_blocked:
                break
            os.kill(bulk.pid, signal.SIGCONT)  # its wait had just timed out: try on the next row
        else:
            raise AssertionError("the bulk run was never caught blocked")
        # The stopped run has been handed the wake-up: the signal must still be in the list.
        assert peer.redis.lrange(K.done(head), 0, -1) == ["done"]
        bulk.kill()  # it dies before it could have put anything back
        bulk.communicate()
        assert peer.redis.lrange(K.done(head), 0, -1) == ["done"]
        assert peer.redis.blmove(K.done(head), K.done(head), 1, "RIGHT", "LEFT") == "done"  # another waiter wakes
        assert client.result(head, timeout=5).id == head
    finally:
        if bulk.poll() is None:
            bulk.kill()
            bulk.communicate()

