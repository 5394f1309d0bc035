# IPython startup script of Sandbar's code-interpreter-v1 template: adds the MIME types E2B's
# SDKs read into Result.data (a DataFrame's columns) and Result.chart (a matplotlib figure's
# data, extracted by e2b-charts).
import IPython
from IPython.core.formatters import BaseFormatter
from traitlets import ObjectName, Unicode


class _SandbarDataFormatter(BaseFormatter):
    format_type = Unicode("e2b/data")
    print_method = ObjectName("_repr_e2b_data_")
    _return_type = (dict, str)

    def __call__(self, obj):
        # Imported on first use so that a kernel starts without loading pandas.
        pandas = __import__("sys").modules.get("pandas")
        if pandas is not None and isinstance(obj, pandas.DataFrame):
            return obj.to_dict(orient="list")
        return super().__call__(obj)


class _SandbarChartFormatter(BaseFormatter):
    format_type = Unicode("e2b/chart")
    print_method = ObjectName("_repr_e2b_chart_")
    _return_type = (dict, str)

    def __call__(self, obj):
        matplotlib_figure = __import__("sys").modules.get("matplotlib.figure")
        if matplotlib_figure is not None and isinstance(obj, matplotlib_figure.Figure):
            try:
                from e2b_charts import chart_figure_to_dict

                return chart_figure_to_dict(obj) or None
            except Exception:
                return None
        return super().__call__(obj)


_ip = IPython.get_ipython()
if _ip is not None:
    _formatters = _ip.display_formatter.formatters
    _formatters["e2b/data"] = _SandbarDataFormatter(parent=_ip.display_formatter)
    _formatters["e2b/chart"] = _SandbarChartFormatter(parent=_ip.display_formatter)
del _ip
