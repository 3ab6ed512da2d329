"""Small utilities the trainer uses: metric tracking, timing, plots, checkpoint layout, progress.

Import from the submodules (`hybridflow.utils.tracking`, ...): this package
deliberately re-exports nothing, so importing one utility never pulls in the
heavy dependencies of another (matplotlib, tensorboard).
"""
