def pytest_configure(config):
    config.addinivalue_line("markers", "docs: builds the documentation site with mkdocs --strict (about 2 minutes)")
