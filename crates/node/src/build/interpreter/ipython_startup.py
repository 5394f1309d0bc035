# IPython startup script of Sandbar's code-interpreter-v1 template: adds the MIME types E2B's
# SDKs read into Result.data (a DataFrame's columns) and Result.chart (a matplotlib figure's
# data, extracted by e2b-charts), gives plain lists and dicts a JSON result, and makes Pillow's
# Image.show() and Image.save(<path>) display the image, as E2B's template does.
import importlib.abc
import json
import sys

import IPython
from IPython.core.formatters import BaseFormatter, JSONFormatter
from traitlets import ObjectName, Unicode


class _SandbarDataFormatter(BaseFormatter):
    format_type = Unicode("e2b/data")
    print_method = ObjectName("_repr_e2b_data_")
    _return_type = (dict, str)

    def __call__(self, obj):
        # Only a DataFrame's own module tells one apart, and pandas is loaded only by code
        # that made one: a kernel starts without it.
        pandas = sys.modules.get("pandas")
        if pandas is not None and isinstance(obj, pandas.DataFrame):
            columns = obj.to_dict(orient="list")
            return {
                name: [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
                for name, values in columns.items()
            }
        return super().__call__(obj)


class _SandbarChartFormatter(BaseFormatter):
    format_type = Unicode("e2b/chart")
    print_method = ObjectName("_repr_e2b_chart_")
    _return_type = (dict, str)

    def __call__(self, obj):
        matplotlib_figure = sys.modules.get("matplotlib.figure")
        if matplotlib_figure is not None and isinstance(obj, matplotlib_figure.Figure):
            try:
                from e2b_charts import chart_figure_to_dict

                return chart_figure_to_dict(obj)
            except Exception:
                return {}
        return super().__call__(obj)


def _plain(value):
    # numpy's arrays and scalars as the lists and numbers they hold.
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(type(value).__name__)


class _SandbarJSONFormatter(JSONFormatter):
    def __call__(self, obj):
        if isinstance(obj, (list, dict)):
            try:
                return json.loads(json.dumps(obj, default=_plain, allow_nan=False)), {"expanded": True}
            except (TypeError, ValueError):
                pass
        return super().__call__(obj)


def _display_on_save(save):
    def saved(image, fp, format=None, **params):
        if isinstance(fp, str):
            from IPython.display import display

            display(image)
        return save(image, fp, format, **params)

    return saved


def _no_viewer(self, path, **options):
    # No program in a sandbox shows a window: Pillow moves on to its IPython viewer.
    return 0


_PILLOW_PATCHES = {
    "PIL.Image": lambda module: setattr(module.Image, "save", _display_on_save(module.Image.save)),
    "PIL.ImageShow": lambda module: setattr(module.UnixViewer, "show_file", _no_viewer),
}


class _SandbarPillowHook(importlib.abc.MetaPathFinder):
    """Patches Pillow's modules as they are imported, so a kernel does not load Pillow to
    start."""

    def find_spec(self, name, path, target=None):
        patch = _PILLOW_PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        load = loader.exec_module

        def exec_module(module):
            load(module)
            try:
                patch(module)
            except Exception:
                pass

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _SandbarPillowHook())
for _name, _patch in _PILLOW_PATCHES.items():
    if _name in sys.modules:
        _patch(sys.modules[_name])

_ip = IPython.get_ipython()
if _ip is not None:
    _formatters = _ip.display_formatter.formatters
    _formatters["e2b/data"] = _SandbarDataFormatter(parent=_ip.display_formatter)
    _formatters["e2b/chart"] = _SandbarChartFormatter(parent=_ip.display_formatter)
    _formatters["application/json"] = _SandbarJSONFormatter(parent=_ip.display_formatter)
del _ip
