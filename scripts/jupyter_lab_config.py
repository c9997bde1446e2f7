# Jupyter config that `make lab` passes with --config: the project's notebooks (the committed
# NN_*.ipynb, scripts/strip_outputs.py PROJECT_NOTEBOOKS) are saved without outputs, execution
# counts or widget state and with their committed metadata, so using them never shows them
# modified in git nor breaks `make test` (tests/app/test_notebooks.py checks the committed files).
# A notebook of your own, a -Copy1 included, is saved as is.
#
# The hook is registered by a contents manager of our own rather than through the
# pre_save_hook option: Jupyter applies this file twice, and setting that option a second time
# prints "Overriding existing pre_save_hook".
import sys
from pathlib import Path

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strip_outputs import as_opened, is_project_notebook, pre_save  # noqa: E402


class StrippingContentsManager(AsyncLargeFileManager):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_pre_save_hook(pre_save)

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        """A project notebook is served with the Python version Lab would write into it on
        opening, so opening it marks nothing modified; saving drops it again (pre_save)."""
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if content and model.get("type") == "notebook" and is_project_notebook(path):
            as_opened(model["content"])
        return model


c = get_config()  # noqa: F821 - provided by the Jupyter config loader
c.ServerApp.contents_manager_class = StrippingContentsManager
# Lab's settings defaults from scripts/lab_settings/overrides.json: no Jupyter news and no update
# check, so no "Would you like to get notified about official Jupyter news?" toast lies over the
# playground's route table (Lab asks while fetchNews is "none", whatever news_url says); a setting
# a user saves still wins. (This folder replaces the environment's <app_dir>/settings, which a
# plain pip or conda install leaves empty.)
c.LabApp.app_settings_dir = str(Path(__file__).resolve().parent / "lab_settings")
c.LabApp.news_url = None
