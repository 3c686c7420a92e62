"""python run_old.py TREE MODULE ARGS...: run MODULE (python -m style) from the code tree TREE, not the installed one."""
import os, runpy, sys
os.environ["PWD_AT"] = os.getcwd()
tree = os.path.abspath(sys.argv[1])
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__ and "editable" not in repr(f)]
sys.path[:] = [tree] + [p for p in sys.path if p not in ("", os.getcwd()) and "editable" not in p]
os.chdir(tree)
for name in [m for m in sys.modules if m.startswith(("liger_dispatch", "benchmarks"))]:
    del sys.modules[name]
module = sys.argv[2] if not sys.argv[2].endswith(".py") else os.path.abspath(os.path.join(os.environ.get("PWD_AT", "."), sys.argv[2]))
sys.argv = [module] + sys.argv[3:]
if module.endswith(".py"):
    runpy.run_path(module, run_name="__main__")
else:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
