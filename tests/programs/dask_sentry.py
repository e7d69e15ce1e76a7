"""Sentry and a Dask task failing on a worker process, for tests/integration/test_dask.py: a
``LocalCluster(processes=True)``, monstack on by ``MONSTACK=1`` (here and in the workers,
which inherit it); the program reports the failure ``future.result()`` re-raises with
``sentry_sdk.capture_exception`` (Dask has no Sentry integration: its workers capture
nothing themselves). Prints the events ``before_send`` kept, as JSON."""

import json

import dask
import distributed
import sentry_sdk

import dask_tasks as tasks

events = []
sentry_sdk.init(before_send=lambda event, hint: events.append(event))

if __name__ == "__main__":
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                                      host="127.0.0.1", worker_dashboard_address=None) as cluster:
            with distributed.Client(cluster) as client:
                future = client.submit(tasks.fail, 3)  # @sentry-submit
                try:
                    future.result(timeout=60)
                except ValueError as exc:
                    sentry_sdk.capture_exception(exc)
    print(json.dumps(events, default=str))
