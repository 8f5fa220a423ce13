package console

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/ops"
)

// plot is one chart of the overview, drawn by the server as inline SVG: a line
// per consumer over the last plotSpan. Colours come from the stylesheet (classes
// s0..s7), so the page needs no inline style.
type plot struct {
	ID, Title string
	// W and H are the viewBox; the chart is the box within the margins.
	W, H                     int
	Left, Top, Right, Bottom int
	LabelX                   int // where the grid lines' labels end
	Lines                    []plotLine
	// YTicks are the horizontal grid lines with their labels.
	YTicks []plotTick
	// XFrom and XTo label the ends of the time axis.
	XFrom, XTo string
}

type plotLine struct {
	Name, Class string
	// Points is the SVG polyline's points attribute: numbers only.
	Points string
	// Last is the latest value, for the legend.
	Last string
}

type plotTick struct {
	Y     int
	Label string
}

const (
	plotW, plotH                   = 640, 180
	plotLeft, plotRight            = 56, 8
	plotTop, plotBottom            = 8, 22
	plotColours                    = 8
	plotInnerW, plotInnerH float64 = plotW - plotLeft - plotRight, plotH - plotTop - plotBottom
)

// plots draws the lag and the rate of each consumer in tr.
func plots(tr *ops.Trends) []plot {
	lag := newPlot("lag-plot", "Lag (messages not yet finished)")
	rate := newPlot("rate-plot", "Rate (deliveries finished per second)")
	from := tr.At.Add(-plotSpan)
	var lagMax, rateMax float64
	for _, c := range tr.Consumers {
		for i, p := range c.Points {
			if p.At.Before(from) {
				continue
			}
			lagMax = max(lagMax, float64(p.Lag))
			if i > 0 {
				rateMax = max(rateMax, p.RatePerSec)
			}
		}
	}
	lagTop, rateTop := niceCeil(lagMax), niceCeil(rateMax)
	lag.YTicks, rate.YTicks = ticks(lagTop), ticks(rateTop)
	x := func(at time.Time) float64 {
		return plotLeft + plotInnerW*at.Sub(from).Seconds()/plotSpan.Seconds()
	}
	y := func(v, top float64) float64 { return plotTop + plotInnerH*(1-v/top) }
	for i, c := range tr.Consumers {
		class := "s" + strconv.Itoa(i%plotColours)
		var lp, rp []string
		for j, p := range c.Points {
			if p.At.Before(from) {
				continue
			}
			lp = append(lp, xy(x(p.At), y(float64(p.Lag), lagTop)))
			// A consumer's first reading has no rate: nothing to compare with.
			if j > 0 {
				rp = append(rp, xy(x(p.At), y(p.RatePerSec, rateTop)))
			}
		}
		lag.Lines = append(lag.Lines, plotLine{Name: c.Name, Class: class, Points: strings.Join(lp, " "), Last: strconv.FormatUint(c.Lag, 10)})
		rate.Lines = append(rate.Lines, plotLine{Name: c.Name, Class: class, Points: strings.Join(rp, " "), Last: fmt.Sprintf("%.1f/s", c.RatePerSec)})
	}
	for _, p := range []*plot{&lag, &rate} {
		p.XFrom = strconv.Itoa(int(plotSpan.Minutes())) + " min ago"
		p.XTo = tr.At.UTC().Format("15:04:05") + "Z"
	}
	return []plot{lag, rate}
}

func newPlot(id, title string) plot {
	return plot{ID: id, Title: title, W: plotW, H: plotH, Left: plotLeft, Top: plotTop, Right: plotW - plotRight, Bottom: plotH - plotBottom, LabelX: plotLeft - 4}
}

func xy(x, y float64) string {
	return strconv.FormatFloat(x, 'f', 1, 64) + "," + strconv.FormatFloat(y, 'f', 1, 64)
}

// niceCeil is the smallest of 1, 2 or 5 times a power of ten that is at least v
// (1 for v at or below 1): the top of an axis.
func niceCeil(v float64) float64 {
	if v <= 1 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

// ticks are four horizontal lines from 0 to top.
func ticks(top float64) []plotTick {
	var out []plotTick
	for i := 0; i <= 4; i++ {
		v := top * float64(i) / 4
		out = append(out, plotTick{Y: int(math.Round(plotTop + plotInnerH*(1-v/top))), Label: strconv.FormatFloat(v, 'g', 4, 64)})
	}
	return out
}
