"""The broker side: what siq_celery patches or calls of kombu's Redis transport (a task
never lost between the broker's list and a consumer's unacked hash, no message left
unread in a paused reply, a dead worker's tasks brought back from a green pool), the
worker's check of its broker at start, and what a green pool (gevent, eventlet) does
differently while its tasks wait. Importing it patches nothing: the worker's and the
producer's paths install what they need (task.install, tasks/worker_hooks.py)."""
