"""``python -m siq_celery.cli``: the ``siq`` command."""

from .main import main

if __name__ == "__main__":
    main()
