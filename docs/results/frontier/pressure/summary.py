import json, statistics, glob, os
for d in sorted(glob.glob('docs/results/frontier/pressure/*.jsonl')):
    rows = [json.loads(l) for l in open(d)]
    def m(key, sl):
        v = [r[key] for r in rows[sl] if key in r]
        return statistics.fmean(v) if v else float('nan')
    print(os.path.basename(d), len(rows),
          'anchor/task first10 %.4f last10 %.4f' % (m('pressure/anchor_to_task', slice(0, 10)), m('pressure/anchor_to_task', slice(-10, None))),
          'guide/task first10 %.4f last10 %.4f' % (m('pressure/guide_to_task', slice(0, 10)), m('pressure/guide_to_task', slice(-10, None))),
          'q %.3f' % m('sage/q_mean', slice(0, None)), 'reward %.3f->%.3f' % (m('reward', slice(0, 10)), m('reward', slice(-10, None))))
