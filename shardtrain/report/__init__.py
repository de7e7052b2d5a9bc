"""``shardtrain report``: a training run's metrics drawn as one HTML page with PNGs (docs/report.md).

``runs`` reads run directories, ``panels`` turns them into plotted data, ``figures`` draws it with
matplotlib, ``html`` writes the page.
"""
