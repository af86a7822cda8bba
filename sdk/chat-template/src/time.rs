//! `strftime_now`'s formatting: Unix seconds to a UTC calendar date and time,
//! written with a C `strftime` format. Hand-written (a few lines of civil
//! calendar arithmetic) so that no date-time crate enters the build.

/// Days since 1970-01-01 → (year, month 1–12, day 1–31), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so that leap days end each 400-year era.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of year from March 1
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// (year, month 1–12, day 1–31) → days since 1970-01-01; inverse of
/// [`civil_from_days`].
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from((month + 9) % 12); // March = 0
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats `secs` since the Unix epoch (UTC) with a C `strftime` format in
/// the C locale: `%Y %y %m %d %e %H %I %M %S %p %B %b %h %A %a %j %%`; any
/// other `%x` is copied as is.
pub(crate) fn strftime_utc(secs: i64, fmt: &str) -> String {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (sod / 3600, sod % 3600 / 60, sod % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month as usize).saturating_sub(1).min(11)];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        for d in [-800_000i64, -1, 0, 59, 60, 11_016, 19_723, 2_000_000] {
            let (y, m, dd) = civil_from_days(d);
            assert_eq!(days_from_civil(y, m, dd), d);
        }
    }

    #[test]
    fn strftime_formats() {
        // 2024-07-26 12:34:56 UTC, a Friday.
        let t = 1_721_997_296;
        assert_eq!(
            strftime_utc(t, "%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %I%p %%"),
            "2024-07-26 12:34:56 Fri Friday Jul July 208 24 12PM %"
        );
        assert_eq!(strftime_utc(t, "%d %b %Y"), "26 Jul 2024");
        // Llama 3.x's default date format, and the edges of the day.
        assert_eq!(strftime_utc(0, "%d %b %Y %e|%I %p"), "01 Jan 1970  1|12 AM");
        assert_eq!(
            strftime_utc(86_399, "%H:%M:%S %j %A"),
            "23:59:59 001 Thursday"
        );
        // 2000-12-31, day 366 of a leap year; before the epoch.
        assert_eq!(strftime_utc(978_220_800, "%j %h"), "366 Dec");
        assert_eq!(
            strftime_utc(-1, "%Y-%m-%d %H:%M:%S %a"),
            "1969-12-31 23:59:59 Wed"
        );
        // Unknown directives and a trailing % are copied.
        assert_eq!(strftime_utc(0, "%Q %"), "%Q %");
    }
}
