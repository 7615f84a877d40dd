pytest_plugins = ["tests.redis_server"]
