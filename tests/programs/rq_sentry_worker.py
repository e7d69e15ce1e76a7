"""A forking RQ worker with Sentry (its RqIntegration), for tests/integration/test_rq.py: ``python
rq_sentry_worker.py REDIS_URL QUEUE DSN`` works the queue until it is empty (burst), the
events going to DSN. monstack is on by ``MONSTACK=1``."""

import sys

import sentry_sdk
from redis import Redis
from rq import Queue, Worker
from sentry_sdk.integrations.rq import RqIntegration

url, name, dsn = sys.argv[1:4]
sentry_sdk.init(dsn=dsn, integrations=[RqIntegration()])


class QuietWorker(Worker):
    """Without the pubsub thread for remote commands (its teardown may wait 60 s)."""

    def subscribe(self) -> None:
        pass


connection = Redis.from_url(url)
QuietWorker([Queue(name, connection=connection)], connection=connection).work(burst=True, logging_level="WARNING")
sentry_sdk.flush(10)
